//! The Ollama API over real HTTP (issue 37, item 2), on the embedded default model: `/api/chat` and
//! `/api/generate` answer as the OpenAI paths do, whole and as NDJSON streams; `format` constrains the
//! answer; tool calls, the listings and the refusals come back in Ollama's shapes.

use crate::apis::{default_model, image_url, ok, validates, weather};
use crate::harness;

use std::net::SocketAddr;

use harness::{get, post};
use serde_json::{json, Value};

/// An Ollama NDJSON stream: its content type checked, each line parsed.
fn ndjson(addr: SocketAddr, path: &str, body: &Value) -> Vec<Value> {
    let r = ureq::post(&format!("http://{addr}{path}"))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
        .expect("stream");
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    use std::io::BufRead;
    std::io::BufReader::new(r.into_reader())
        .lines()
        .map_while(Result::ok)
        .map(|l| serde_json::from_str(&l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// The image of [`image_url`] as Ollama sends it: bare base64.
fn image_b64() -> String {
    image_url().split_once(",").expect("a data URL").1.to_string()
}

/// Issue 37, item 2: `/api/chat` runs the chat path: greedy, the same answer as chat completions with
/// the same image and text; streamed as NDJSON lines whose texts add up to the whole answer, the last
/// with `done`, Ollama's done reason, counts and durations (nanoseconds, the prompt's and the answer's
/// adding up to at most the total).
#[test]
fn ollama_chat_answers_as_chat_completions_does_whole_and_streamed() {
    let addr = default_model();
    let openai = ok(
        addr,
        "/v1/chat/completions",
        &json!({"temperature": 0, "max_tokens": 16, "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": image_url()}}, {"type": "text", "text": "What is in the image?"}]}]}),
    );
    let body = json!({"model": "osprey-default:latest", "stream": false, "options": {"temperature": 0, "num_predict": 16},
        "messages": [{"role": "user", "content": "What is in the image?", "images": [image_b64()]}]});
    let whole = ok(addr, "/api/chat", &body);
    assert_eq!(whole["message"]["content"], openai["choices"][0]["message"]["content"], "{whole}");
    assert_eq!(
        (whole["message"]["role"].as_str(), whole["done"].as_bool(), whole["done_reason"].as_str()),
        (Some("assistant"), Some(true), Some("stop"))
    );
    assert_eq!(whole["prompt_eval_count"], openai["usage"]["prompt_tokens"]);
    assert_eq!(whole["eval_count"], openai["usage"]["completion_tokens"]);
    let ns = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
    assert!(
        ns(&whole, "prompt_eval_duration") + ns(&whole, "eval_duration") <= ns(&whole, "total_duration"),
        "{whole}"
    );
    assert!(ns(&whole, "eval_duration") > 0, "{whole}");
    let mut streamed = body.clone();
    streamed.as_object_mut().expect("object").remove("stream"); // streaming is Ollama's default
    let lines = ndjson(addr, "/api/chat", &streamed);
    let (last, rest) = lines.split_last().expect("lines");
    assert!(rest
        .iter()
        .all(|l| l["done"] == false && l["model"] == "osprey-default:latest" && l["created_at"].is_string()));
    let text: String = rest.iter().filter_map(|l| l["message"]["content"].as_str()).collect();
    assert_eq!(text, whole["message"]["content"].as_str().expect("text"));
    assert_eq!(
        (last["done"].as_bool(), last["done_reason"].as_str(), &last["eval_count"]),
        (Some(true), Some("stop"), &whole["eval_count"])
    );
}

/// `/api/generate`: `system` and `prompt` as the chat turns they are, a raw prompt as `/v1/completions`
/// runs it, `num_predict` as the budget (`done_reason: "length"`), and an empty prompt as Ollama's
/// load request.
#[test]
fn ollama_generate_runs_templated_and_raw_prompts() {
    let addr = default_model();
    let chat = ok(
        addr,
        "/v1/chat/completions",
        &json!({"temperature": 0, "max_tokens": 24,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe a red circle."}]}),
    );
    let g = ok(
        addr,
        "/api/generate",
        &json!({"model": "osprey-default", "stream": false, "system": "Be brief.",
        "prompt": "Describe a red circle.", "options": {"temperature": 0, "num_predict": 24}}),
    );
    assert_eq!(g["response"], chat["choices"][0]["message"]["content"], "{g}");
    let c = ok(addr, "/v1/completions", &json!({"prompt": "a red", "temperature": 0, "max_tokens": 5}));
    let raw = ok(
        addr,
        "/api/generate",
        &json!({"model": "osprey-default", "stream": false, "raw": true, "prompt": "a red",
        "options": {"temperature": 0, "num_predict": 5}}),
    );
    assert_eq!(raw["response"], c["choices"][0]["text"], "{raw}");
    assert_eq!((raw["done_reason"].as_str(), raw["eval_count"].as_u64()), (Some("length"), Some(5)));
    let load = ok(addr, "/api/generate", &json!({"model": "osprey-default"}));
    assert_eq!(
        (load["done"].as_bool(), load["done_reason"].as_str(), load["response"].as_str()),
        (Some(true), Some("load"), Some(""))
    );
}

/// `format` runs through the same constrained decoding as `response_format`: a JSON Schema's answer
/// validates, `"json"` gives a JSON object.
#[test]
fn ollama_format_constrains_the_answer() {
    let addr = default_model();
    let schema = json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"], "additionalProperties": false});
    for (format, check) in [(schema.clone(), true), (json!("json"), false)] {
        let v = ok(
            addr,
            "/api/chat",
            &json!({"model": "osprey-default", "stream": false, "format": format, "options": {"num_predict": 40, "seed": 3},
            "messages": [{"role": "user", "content": "Describe a red circle."}]}),
        );
        let answer: Value = serde_json::from_str(v["message"]["content"].as_str().expect("content")).expect("JSON");
        assert!(answer.is_object() && (!check || validates(&schema, &answer)), "{answer}");
    }
}

/// A forced call (osprey's `tool_choice` and `parallel_tool_calls` on `/api/chat`: Ollama has neither,
/// and the default model calls only when forced) comes back in Ollama's shape, arguments as an object, whole and streamed.
#[test]
fn ollama_tool_calls_come_back_in_ollama_shape() {
    let addr = default_model();
    let body = json!({"model": "osprey-default", "stream": false, "tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false,
        "options": {"temperature": 0}, "messages": [{"role": "user", "content": "Weather in Paris for two days?"}]});
    let v = ok(addr, "/api/chat", &body);
    let calls = v["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(validates(&weather()["function"]["parameters"], &calls[0]["function"]["arguments"]), "{v}");
    assert_eq!(v["done_reason"], "stop");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let lines = ndjson(addr, "/api/chat", &streamed);
    let call_lines: Vec<&Value> = lines.iter().filter(|l| l["message"]["tool_calls"].is_array()).collect();
    assert_eq!(call_lines.len(), 1, "{lines:?}");
    assert_eq!(call_lines[0]["message"]["tool_calls"], v["message"]["tool_calls"]);
    // The call and its result go back as Ollama sends them (no ids; the result names its tool).
    let mut next = body.clone();
    next.as_object_mut().expect("object").remove("tool_choice");
    next["messages"]
        .as_array_mut()
        .expect("list")
        .extend([v["message"].clone(), json!({"role": "tool", "content": "sunny", "tool_name": "get_weather"})]);
    let after = ok(addr, "/api/chat", &next);
    assert!(after["prompt_eval_count"].as_u64() > v["prompt_eval_count"].as_u64(), "{after}");
}

/// `/api/tags`, `/api/show`, `/api/ps` and `/api/version` describe the served model in Ollama's fields.
#[test]
fn ollama_listings_describe_the_served_model() {
    let addr = default_model();
    let (s, tags) = get(addr, "/api/tags");
    let tags: Value = serde_json::from_str(&tags).expect("json");
    assert_eq!(s, 200);
    let m = &tags["models"][0];
    assert_eq!(m["name"], "osprey-default:latest");
    assert!(m["size"].as_u64() > Some(1_000_000) && m["digest"].as_str().is_some_and(|d| d.len() == 64), "{m}");
    assert_eq!(
        (m["details"]["format"].as_str(), m["details"]["family"].as_str()),
        (Some("safetensors"), Some("qwen3_5_moe"))
    );
    assert!(m["details"]["parameter_size"].as_str().is_some_and(|p| p.ends_with('M')), "{m}");
    let show = ok(addr, "/api/show", &json!({"model": "osprey-default:latest"}));
    let caps: Vec<&str> = show["capabilities"].as_array().expect("caps").iter().filter_map(Value::as_str).collect();
    assert!(caps.contains(&"completion") && caps.contains(&"vision") && caps.contains(&"tools"), "{caps:?}");
    assert!(show["template"].as_str().is_some_and(|t| t.contains("<|im_start|>")));
    assert_eq!(show["model_info"]["qwen3_5_moe.context_length"], 4096);
    let (_, ps) = get(addr, "/api/ps");
    let ps: Value = serde_json::from_str(&ps).expect("json");
    assert_eq!((&ps["models"][0]["name"], &ps["models"][0]["context_length"]), (&m["name"], &json!(4096)));
    let (_, version) = get(addr, "/api/version");
    assert!(serde_json::from_str::<Value>(&version).expect("json")["version"].is_string());
}

/// Every refusal is Ollama's `{"error": "..."}` naming the field as Ollama does: an unknown model (404),
/// a field Ollama's API does not have, a sampler that is not offered, a request the budget cannot
/// hold. A body without the JSON content type is read (Ollama's own examples are `curl -d`) unless a
/// browser sent it (it has an `Origin`).
#[test]
fn ollama_refusals_are_errors_in_ollama_shape() {
    let addr = default_model();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"model": "llama3.2", "messages": msgs}), 404, "model \"llama3.2\" not found"),
        (
            json!({"model": "osprey-default", "messages": msgs, "prompt": "x"}),
            400,
            "`prompt` is not a field of /api/chat",
        ),
        (
            json!({"model": "osprey-default", "messages": msgs, "options": {"mirostat": 2}}),
            400,
            "options.mirostat: mirostat sampling",
        ),
        (
            json!({"model": "osprey-default", "messages": msgs, "stream": false, "format": {"type": "object", "properties": {"a": {"type": "string", "minLength": 30}}, "required": ["a"]},
            "options": {"num_predict": 2}}),
            400,
            "options.num_predict 2 cannot hold",
        ),
    ];
    for (body, status, text) in cases {
        let (s, e) = post(addr, "/api/chat", &body.to_string(), None);
        assert_eq!(s, status, "{e}");
        assert_eq!(e.as_object().map(|o| o.len()), Some(1), "only `error`: {e}");
        assert!(e["error"].as_str().is_some_and(|m| m.contains(text)), "{e} lacks {text:?}");
    }
    let body = json!({"model": "osprey-default", "stream": false, "messages": msgs, "options": {"num_predict": 2}})
        .to_string();
    let send = |headers: &[(&str, &str)]| {
        let mut h = vec![("Host", "localhost"), ("Content-Type", "application/x-www-form-urlencoded")];
        h.extend_from_slice(headers);
        let mut sock = std::net::TcpStream::connect(addr).expect("connect");
        use std::io::{Read, Write};
        sock.write_all(harness::raw_request("POST", "/api/chat", &h, &body).as_bytes()).expect("send");
        let mut out = String::new();
        sock.read_to_string(&mut out).expect("read");
        out
    };
    assert!(send(&[]).starts_with("HTTP/1.1 200"), "curl -d");
    assert!(send(&[("Origin", "http://example.com")]).starts_with("HTTP/1.1 415"), "a browser's form");
}
