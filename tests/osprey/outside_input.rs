//! Issue 49's probe, replayed over real HTTP: the schema that compiled forever, forced calls whose
//! parameters are written as pydantic writes them (`$defs`, `$ref`, Enums), and errors that echoed a
//! client's strings whole. Each test fails on the code before its fix.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::hardening::{schema_carriers, server};
use crate::harness::{self, post};

/// `{"allOf": [{"type": "string", "pattern": "^(.*a.{i})"} for i in 1..24]}`: 1.2 KB of JSON whose
/// compile doubled with each pattern (24 never answered, growing gigabytes).
fn pattern_bomb() -> Value {
    let all: Vec<Value> = (1..24).map(|i| json!({"type": "string", "pattern": format!("^(.*a.{{{i}}})")})).collect();
    json!({"allOf": all})
}

/// The bomb is refused at the schema gate on every carrier within 2 s (no grammar work starts, so no
/// tokenizer worker is held), and a plain and a structured request sent right after are answered.
#[test]
fn the_pattern_bomb_is_refused_on_every_carrier_and_requests_beside_it_are_answered() {
    let addr = server();
    let bomb = pattern_bomb();
    assert!(bomb.to_string().len() < 1400, "the 1.2 KB schema of the report");
    for (path, body, param) in schema_carriers(&bomb) {
        let t = Instant::now();
        let (s, e) = post(addr, path, &body.to_string(), None);
        let took = t.elapsed();
        assert_eq!(s, 400, "{path} {param}: {e}");
        assert!(e.to_string().contains("at most 8"), "{path} {param}: {e}");
        assert!(took < Duration::from_secs(2), "{path} {param}: refused after {took:?}");
    }
    let plain = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0});
    assert_eq!(post(addr, "/v1/chat/completions", &plain.to_string(), None).0, 200);
    let schema = json!({"type": "object", "properties": {"color": {"enum": ["red", "green"]},
        "code": {"type": "string", "pattern": "^[a-z]{2}$"}}, "required": ["color", "code"], "additionalProperties": false});
    let structured = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}});
    let (s, e) = post(addr, "/v1/chat/completions", &structured.to_string(), None);
    assert_eq!(s, 200, "{e}");
}

/// Parameters as pydantic writes them: a nested model and an Enum behind `$ref`s into `$defs`, a
/// field with a default beside its `$ref`.
fn pydantic_parameters() -> Value {
    json!({
        "$defs": {
            "Color": {"enum": ["red", "green", "blue"], "title": "Color", "type": "string"},
            "Shape": {"properties": {"name": {"maxLength": 12, "title": "Name", "type": "string"},
                                     "sides": {"maximum": 12, "minimum": 0, "title": "Sides", "type": "integer"}},
                      "required": ["name", "sides"], "title": "Shape", "type": "object", "additionalProperties": false}
        },
        "properties": {"color": {"$ref": "#/$defs/Color"}, "shape": {"$ref": "#/$defs/Shape"},
                       "tint": {"$ref": "#/$defs/Color", "default": "red"}},
        "required": ["color", "shape"], "title": "Drawing", "type": "object", "additionalProperties": false
    })
}

/// The arguments of the first call in an answer of any API, as JSON.
fn first_call_arguments(path: &str, v: &Value) -> Option<Value> {
    let parse =
        |a: &Value| a.as_str().and_then(|s| serde_json::from_str(s).ok()).or_else(|| a.is_object().then(|| a.clone()));
    match path {
        "/v1/chat/completions" => parse(&v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]),
        "/v1/responses" => {
            v["output"].as_array()?.iter().find(|o| o["type"] == "function_call").and_then(|o| parse(&o["arguments"]))
        }
        "/v1/messages" => v["content"].as_array()?.iter().find(|c| c["type"] == "tool_use").map(|c| c["input"].clone()),
        _ => parse(&v["message"]["tool_calls"][0]["function"]["arguments"]),
    }
}

/// Nested-model and Enum forced calls were refused with "Pointer '/$defs/S' does not exist" (naming
/// `response_format`) on every API: each parameter compiled as its own root. Now each carrier answers a
/// call whose arguments validate against the tool's schema, the Enum as its string, the nested model as
/// an object.
#[test]
fn forced_calls_with_defs_and_enums_validate_on_every_carrier() {
    let addr = server();
    let params = pydantic_parameters();
    let validator = jsonschema::validator_for(&params).expect("a valid schema");
    let user = json!([{"role": "user", "content": "Draw a red triangle."}]);
    let chat_tool = json!([{"type": "function", "function": {"name": "draw", "parameters": params}}]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 160, "temperature": 0, "tools": chat_tool, "tool_choice": "required"}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 160, "temperature": 0, "tools": chat_tool,
            "tool_choice": {"type": "function", "function": {"name": "draw"}}}),
        ),
        (
            "/v1/responses",
            json!({"input": "Draw a red triangle.", "max_output_tokens": 160, "temperature": 0,
            "tools": [{"type": "function", "name": "draw", "parameters": params, "strict": true}], "tool_choice": "required"}),
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 160, "temperature": 0,
            "tools": [{"name": "draw", "input_schema": params}], "tool_choice": {"type": "any"}}),
        ),
        (
            "/api/chat",
            json!({"model": "qwen3_5_moe-tiny", "messages": user, "stream": false, "options": {"num_predict": 160, "temperature": 0},
            "tools": chat_tool, "tool_choice": "required"}),
        ),
    ];
    for (path, body) in cases {
        let (s, v) = post(addr, path, &body.to_string(), None);
        assert_eq!(s, 200, "{path}: {v}");
        let args = first_call_arguments(path, &v).unwrap_or_else(|| panic!("{path}: no call: {v}"));
        assert!(validator.is_valid(&args), "{path}: {args} does not validate");
        assert!(args["color"].is_string() && args["shape"].is_object(), "{path}: {args}");
    }
}

/// A refusal of a forced call's grammar names `tools`, not a `response_format` that was not sent.
#[test]
fn a_refused_call_grammar_names_tools() {
    let addr = server();
    let params = json!({"type": "object", "properties": {"s": {"$ref": "#/$defs/Missing"}}, "required": ["s"]});
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tools": tools, "tool_choice": "required"});
    let (s, e) = post(addr, "/v1/chat/completions", &body.to_string(), None);
    assert_eq!(s, 400, "{e}");
    assert_ne!(e["error"]["param"], "response_format", "{e}");
}

/// A 1 MB role came back as a 1 MB error: messages and parameters are cut to a bound.
#[test]
fn errors_do_not_echo_a_clients_strings_whole() {
    let addr = server();
    let role = "r".repeat(1 << 20);
    let body = json!({"messages": [{"role": role, "content": "hi"}], "max_tokens": 4});
    let (s, e) = post(addr, "/v1/chat/completions", &body.to_string(), None);
    assert_eq!(s, 400, "{}", &e.to_string()[..200]);
    assert!(e.to_string().len() < 2048, "a {}-byte error", e.to_string().len());
    let (s, e) = post(
        addr,
        "/api/chat",
        &json!({"model": "qwen3_5_moe-tiny", "messages": [{"role": role, "content": "hi"}]}).to_string(),
        None,
    );
    assert!(s == 400 && e.to_string().len() < 2048, "{s}: a {}-byte error", e.to_string().len());
    assert_eq!(harness::get(addr, "/health").0, 200);
}

/// Streams whose clients hung up while queued were prefilled in full when admitted (20 abandoned
/// 3.3k-token streams cost 66,430 prompt tokens); non-streamed ones were cancelled at once. Here one
/// long answer holds the only running slot while five streamed requests queue behind it and hang up
/// after their first frame: each is cancelled while the long answer still runs, and no prompt token of
/// theirs is computed. Mutation-checked: without `tx.closed()` in `pump` they are prefilled when the
/// slot frees.
#[test]
fn streams_abandoned_while_queued_are_cancelled_before_prefill() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let settings = osprey::Settings { max_running_requests: Some(1), ..osprey::Settings::default() };
    let addr = harness::start(settings, crate::common::fixtures().join("models/qwen3_5_moe-tiny"));
    let count = |name: &str| harness::metric(addr, name) as u64;
    let long = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3500, "ignore_eos": true});
    let mut holder = TcpStream::connect(addr).expect("connect");
    holder.write_all(harness::raw_json_post("/v1/chat/completions", &long.to_string()).as_bytes()).expect("send");
    while count("osprey_generated_tokens_total") < 8 {
        std::thread::yield_now();
    }
    let (prompt0, cancelled0) = (count("osprey_prompt_tokens_total"), count("osprey_cancelled_total"));
    let text = "word ".repeat(600);
    for _ in 0..5 {
        let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 8, "stream": true});
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(harness::raw_json_post("/v1/chat/completions", &body.to_string()).as_bytes()).expect("send");
        // Queued: the headers and the role frame arrive, then the client leaves.
        let mut first = [0u8; 64];
        let n = s.read(&mut first).expect("the answer starts");
        assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"), "{:?}", &first[..n]);
    }
    let t = Instant::now();
    while count("osprey_cancelled_total") < cancelled0 + 5 {
        assert!(t.elapsed() < Duration::from_secs(120), "abandoned streams were not cancelled");
        std::thread::yield_now();
    }
    let generated_then = count("osprey_generated_tokens_total");
    assert_eq!(count("osprey_prompt_tokens_total"), prompt0, "an abandoned stream's prompt was computed");
    assert!(generated_then < 3500, "the long answer had ended first ({generated_then} tokens): nothing was queued");
    drop(holder);
    assert_eq!(harness::get(addr, "/health").0, 200);
}

/// A tokenizer whose ids go past the model's vocabulary passed the load, and then every chat got 500
/// while `/health` said ok. The load now refuses it and names the token.
#[test]
fn a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_at_load() {
    let src = crate::common::fixtures().join("models/qwen3_5_moe-tiny");
    let dir = harness::scratch_dir("tokenizer-beyond-vocab");
    for f in std::fs::read_dir(&src).expect("fixture") {
        let f = f.expect("entry").path();
        std::fs::copy(&f, dir.join(f.file_name().expect("name"))).expect("copy");
    }
    let mut tok: Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).expect("read")).expect("json");
    // The BPE vocabulary's ids are taken as written (added tokens are renumbered by the tokenizer).
    tok["model"]["vocab"]["<|evil|>"] = json!(5000);
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write");
    let Err(e) = osprey::start(&osprey::Settings::default(), &dir) else { panic!("the load was not refused") };
    let msg = format!("{e:#}");
    assert!(msg.contains("<|evil|>") && msg.contains("5000") && msg.contains("1024"), "{msg}");
}

/// `method path` with `headers` and `body`: (status, `Allow` header, JSON body).
fn call(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, Value) {
    let mut req = ureq::request(method, &format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let r = match req.send_string(body) {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("transport error: {e}"),
    };
    let (status, allow) = (r.status(), r.header("allow").unwrap_or_default().to_string());
    let text = r.into_string().expect("body");
    (status, allow, serde_json::from_str(&text).unwrap_or_else(|_| panic!("{method} {path}: not JSON: {text:?}")))
}

/// Errors no API handler shaped came in OpenAI's envelope whatever the client: unserved Ollama routes
/// and 405s (the `ollama` client's `ResponseError.error` was a dict), a too-large `/api/show` (a plain-
/// text 413), and `GET /v1/models/{unknown}` from an Anthropic client. Each now has its client's shape.
#[test]
fn errors_outside_the_handlers_answer_in_the_clients_shape() {
    let addr = server();
    for (method, path) in
        [("POST", "/api/embed"), ("POST", "/api/pull"), ("DELETE", "/api/delete"), ("GET", "/api/chat")]
    {
        let (status, allow, v) = call(addr, method, path, &[("content-type", "application/json")], "{}");
        assert!(v["error"].is_string(), "{method} {path}: {status} {v}");
        if path == "/api/chat" {
            assert_eq!((status, allow.as_str()), (405, "POST"), "{v}");
        }
    }
    let big = json!({"model": "qwen3_5_moe-tiny", "pad": "x".repeat(300 << 10)}).to_string();
    let (status, _, v) = call(addr, "POST", "/api/show", &[("content-type", "application/json")], &big);
    assert!(status == 413 && v["error"].is_string(), "{status} {v}");
    let anthropic = [("anthropic-version", "2023-06-01")];
    let (status, _, v) = call(addr, "GET", "/v1/models/claude-nothing", &anthropic, "");
    assert_eq!(status, 404, "{v}");
    assert!(v["type"] == "error" && v["error"]["type"] == "not_found_error", "{v}");
    let (status, allow, v) = call(addr, "GET", "/v1/messages", &anthropic, "");
    assert!(status == 405 && allow == "POST" && v["type"] == "error", "{status} {v}");
    let (status, _, v) = call(addr, "GET", "/v1/models/nothing", &[], "");
    assert!(status == 404 && v["error"]["code"].is_string(), "{v}");
    let (status, _, v) = call(addr, "GET", "/v1/models/qwen3_5_moe-tiny", &[], "");
    assert!(status == 200 && v["id"] == "qwen3_5_moe-tiny", "{v}");
}

/// `logit_bias` was accepted and had no effect. Now +100 on a token makes a greedy answer that token
/// throughout (two different tokens, two different answers), on completions and chat; bad keys and
/// values are refused naming `logit_bias`.
#[test]
fn logit_bias_is_applied_and_checked() {
    let addr = server();
    let tokens_with = |bias: Value| -> Vec<String> {
        let body =
            json!({"prompt": "The weather", "max_tokens": 4, "temperature": 0, "logprobs": 0, "logit_bias": bias});
        let (s, v) = post(addr, "/v1/completions", &body.to_string(), None);
        assert_eq!(s, 200, "{v}");
        v["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_str().unwrap_or("").to_string())
            .collect()
    };
    let (a, b) = (tokens_with(json!({"100": 100})), tokens_with(json!({"200": 100})));
    assert!(a.len() == 4 && a.iter().all(|t| *t == a[0]), "{a:?}");
    assert!(b.len() == 4 && b.iter().all(|t| *t == b[0]), "{b:?}");
    assert_ne!(a[0], b[0]);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "logit_bias": {"100": 100}, "chat_template_kwargs": {"enable_thinking": false}});
    let (s, v) = post(addr, "/v1/chat/completions", &chat.to_string(), None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap_or(""), a[0].repeat(3), "{v}");
    for bad in [json!({"abc": 1}), json!({"99999": 1}), json!({"100": 101}), json!({"100": "x"})] {
        let body = json!({"prompt": "hi", "max_tokens": 2, "logit_bias": bad});
        let (s, e) = post(addr, "/v1/completions", &body.to_string(), None);
        assert!(s == 400 && e["error"]["param"] == "logit_bias", "{bad}: {e}");
    }
}

/// The deprecated `functions` and `function_call` were ignored. They are mapped to tools as OpenAI maps
/// them, and the answer is in their shape: one `function_call`, `finish_reason: "function_call"`, whole
/// and streamed; the next turn may carry the call and a `function` message; mixing both forms is 400.
#[test]
fn legacy_functions_are_tools_answered_in_their_own_shape() {
    let addr = server();
    let functions = json!([{"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": false}}]);
    let user = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let body = json!({"messages": user, "max_tokens": 64, "temperature": 0, "functions": functions,
        "function_call": {"name": "get_weather"}});
    let (s, v) = post(addr, "/v1/chat/completions", &body.to_string(), None);
    assert_eq!(s, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "function_call", "{v}");
    assert!(choice["message"]["tool_calls"].is_null(), "{v}");
    let call = &choice["message"]["function_call"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON arguments");
    assert!(args["city"].is_string(), "{args}");
    // Streamed: the call's name, then its arguments, as `function_call` deltas.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let frames: Vec<Value> = harness::sse(addr, "/v1/chat/completions", &streamed)
        .iter()
        .filter(|f| *f != "[DONE]")
        .map(|f| serde_json::from_str(f).expect("frame"))
        .collect();
    let name: String =
        frames.iter().filter_map(|f| f["choices"][0]["delta"]["function_call"]["name"].as_str()).collect();
    let arguments: String =
        frames.iter().filter_map(|f| f["choices"][0]["delta"]["function_call"]["arguments"].as_str()).collect();
    assert_eq!((name.as_str(), arguments.as_str()), ("get_weather", call["arguments"].as_str().unwrap_or("")));
    assert!(frames.iter().any(|f| f["choices"][0]["finish_reason"] == "function_call"));
    // The next turn, in the legacy form.
    let turn = json!({"messages": [user[0], {"role": "assistant", "content": null, "function_call": call},
        {"role": "function", "name": "get_weather", "content": "{\"temp\": 21}"}], "max_tokens": 8, "functions": functions});
    let (s, v) = post(addr, "/v1/chat/completions", &turn.to_string(), None);
    assert_eq!(s, 200, "{v}");
    let tools = json!([{"type": "function", "function": functions[0]}]);
    let both = json!({"messages": user, "max_tokens": 8, "functions": functions, "tools": tools});
    let (s, e) = post(addr, "/v1/chat/completions", &both.to_string(), None);
    assert!(s == 400 && e["error"]["param"] == "functions", "{e}");
}

/// A PNG that declares `w`×`h` in a valid header and then has no decodable pixels.
fn declared_png(w: u32, h: u32) -> Vec<u8> {
    fn crc32(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in bytes {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 == 1 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    let chunk = |kind: &[u8], data: &[u8]| {
        let mut out = (data.len() as u32).to_be_bytes().to_vec();
        let body = [kind, data].concat();
        out.extend(&body);
        out.extend(crc32(&body).to_be_bytes());
        out
    };
    let ihdr = [w.to_be_bytes().as_slice(), h.to_be_bytes().as_slice(), &[8, 2, 0, 0, 0]].concat();
    [b"\x89PNG\r\n\x1a\n".as_slice(), &chunk(b"IHDR", &ihdr), &chunk(b"IDAT", &[0u8; 64]), &chunk(b"IEND", &[])]
        .concat()
}

/// Three 64 Mpx images were decoded for 4.5 s before the context refused them. Every item's declared size
/// is now checked before any is decoded: images whose soft tokens cannot fit the context are refused as
/// `context_length_exceeded` from their headers alone (these have no decodable pixels: decoding first
/// answered `invalid_media`), and a request's pixel budget is taken over all items first.
#[test]
fn media_is_refused_by_declared_size_before_anything_is_decoded() {
    use base64::Engine;
    let addr = server();
    let part = |png: Vec<u8>| {
        let url = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png));
        json!({"type": "image_url", "image_url": {"url": url}})
    };
    let ask = |parts: Vec<Value>| {
        let mut content = parts;
        content.push(json!({"type": "text", "text": "What is this?"}));
        let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 4});
        post(addr, "/v1/chat/completions", &body.to_string(), None)
    };
    let (s, e) =
        ask(vec![part(declared_png(8000, 8000)), part(declared_png(8000, 8000)), part(declared_png(8000, 8000))]);
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{e}");
    assert_eq!(e["error"]["param"], "media[0]", "{e}");
    // Four images of 60 Mpx, each within the per-image bound: the fourth passes the 192 Mpx budget, and
    // the request is refused on its declared sizes (it was the first one's corrupt pixels before).
    let big = || part(declared_png(7746, 7746));
    let (s, e) = ask(vec![big(), big(), big(), big()]);
    assert!(s == 400 || s == 413, "{s} {e}");
    assert_ne!(e["error"]["code"], "invalid_media", "decoded before the declared sizes were checked: {e}");
    // A small image with no decodable pixels still gets the decoder's answer.
    let (s, e) = ask(vec![part(declared_png(64, 64))]);
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("invalid_media")), "{e}");
}

/// A 700-hop `$ref` chain inside one property passed the 64-hop bound, because the property compiled
/// as its own root, where its nested `$defs` resolved (200 after 13.6 s). Now a property's pointers mean
/// what they mean in the tool's schema: the chain names nothing there, and the request is a quick 400.
#[test]
fn a_ref_chain_hidden_in_a_property_is_refused_quickly() {
    let addr = server();
    let mut defs = serde_json::Map::new();
    for i in 0..700 {
        let next = if i + 1 < 700 { json!({"$ref": format!("#/$defs/d{}", i + 1)}) } else { json!({"type": "string"}) };
        defs.insert(format!("d{i}"), next);
    }
    let params =
        json!({"type": "object", "properties": {"p": {"$defs": defs, "$ref": "#/$defs/d0"}}, "required": ["p"]});
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "tools": tools, "tool_choice": "required"});
    let t = Instant::now();
    let (s, e) = post(addr, "/v1/chat/completions", &body.to_string(), None);
    assert_eq!(s, 400, "{e}");
    assert!(t.elapsed() < Duration::from_secs(2), "refused after {:?}", t.elapsed());
}
