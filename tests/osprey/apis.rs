//! Tool calls, structured output, the Responses API and the Anthropic Messages API over real HTTP, on
//! the embedded default model and a random-weight fixture: calls parse, stream and round-trip (an image
//! in a tool result included); schema-constrained output validates for 20 schemas; the three front ends
//! give the same prompt and the same greedy tokens; every new refusal has its code.

use crate::harness;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;

use harness::{data_url, post, sse, start};
use osprey::Settings;
use serde_json::{json, Value};

fn exact() -> Settings {
    Settings { activations: Some("f32".into()), ..Settings::default() }
}

/// The embedded default model.
pub(crate) fn default_model() -> SocketAddr {
    static S: OnceLock<SocketAddr> = OnceLock::new();
    *S.get_or_init(|| start(exact(), osprey::model_dir(&Settings::default()).expect("default model")))
}

/// A random-weight Qwen3.5 MoE checkpoint.
fn random_model() -> SocketAddr {
    static S: OnceLock<SocketAddr> = OnceLock::new();
    *S.get_or_init(|| {
        start(exact(), PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen3_5_moe-tiny"))
    })
}

pub(crate) fn image_url() -> String {
    data_url(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/media/default/blue_triangle_img0.png"))
}

pub(crate) fn ok(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (s, v) = post(addr, path, &body.to_string(), None);
    assert_eq!(s, 200, "{path}: {v}");
    v
}

pub(crate) fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"]}}})
}

fn screenshot() -> Value {
    json!({"type": "function", "function": {"name": "take_screenshot",
        "parameters": {"type": "object", "properties": {"window": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["window"]}}})
}

pub(crate) fn validates(schema: &Value, v: &Value) -> bool {
    jsonschema::validator_for(schema).expect("a valid schema").is_valid(v)
}

#[test]
fn a_forced_call_parses_validates_and_streams_the_same() {
    // The random model chains calls until its budget wraps it up (parallel), or makes one.
    for (addr, parallel) in [(default_model(), true), (random_model(), true), (random_model(), false)] {
        let body = json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [weather(), screenshot()], "tool_choice": "required", "parallel_tool_calls": parallel,
            "max_tokens": 160, "temperature": 0});
        let v = ok(addr, "/v1/chat/completions", &body);
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
        let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
        assert!(!calls.is_empty());
        for c in calls {
            assert_eq!(c["type"], "function");
            assert!(c["id"].as_str().is_some_and(|id| id.starts_with("call_")));
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().expect("arguments")).expect("JSON");
            let tool = [weather(), screenshot()]
                .into_iter()
                .find(|t| t["function"]["name"] == c["function"]["name"])
                .expect("a known tool");
            assert!(validates(&tool["function"]["parameters"], &args), "{args} against {tool}");
        }
        // Streamed: per call, id and name first with empty arguments, then fragments that add up.
        let mut s = body.clone();
        s["stream"] = true.into();
        let mut streamed: Vec<(String, String, String)> = Vec::new();
        let mut finish = None;
        for d in sse(addr, "/v1/chat/completions", &s).iter().filter(|d| *d != "[DONE]") {
            let c: Value = serde_json::from_str(d).expect("chunk");
            let ch = &c["choices"][0];
            if let Some(f) = ch["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
            for tc in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let i = tc["index"].as_u64().expect("index") as usize;
                if i == streamed.len() {
                    assert_eq!(tc["function"]["arguments"], "", "the first delta of a call carries no arguments");
                    streamed.push((
                        tc["id"].as_str().expect("id").into(),
                        tc["function"]["name"].as_str().expect("name").into(),
                        String::new(),
                    ));
                } else {
                    assert!(tc.get("id").is_none());
                    streamed[i].2.push_str(tc["function"]["arguments"].as_str().expect("fragment"));
                }
            }
        }
        assert_eq!(finish.as_deref(), Some("tool_calls"));
        let whole: Vec<(String, String, String)> = calls
            .iter()
            .map(|c| {
                (
                    c["id"].as_str().unwrap_or_default().into(),
                    c["function"]["name"].as_str().unwrap_or_default().into(),
                    c["function"]["arguments"].as_str().unwrap_or_default().into(),
                )
            })
            .collect();
        assert_eq!(
            streamed.iter().map(|c| (&c.1, &c.2)).collect::<Vec<_>>(),
            whole.iter().map(|c| (&c.1, &c.2)).collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_named_choice_and_one_call_at_a_time_are_obeyed() {
    let addr = default_model();
    let body = json!({"messages": [{"role": "user", "content": "Show me window 2."}],
        "tools": [weather(), screenshot()], "tool_choice": {"type": "function", "function": {"name": "take_screenshot"}},
        "parallel_tool_calls": false, "max_tokens": 60, "temperature": 0});
    let v = ok(addr, "/v1/chat/completions", &body);
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().expect("tool_calls").clone();
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["function"]["name"], "take_screenshot");
    // tool_choice none: tools are not offered, nothing is parsed.
    let none = json!({"messages": [{"role": "user", "content": "Describe a red square."}], "tools": [weather()],
        "tool_choice": "none", "max_tokens": 16, "temperature": 0});
    let v = ok(addr, "/v1/chat/completions", &none);
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert_ne!(v["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn calls_and_results_round_trip_with_an_image_result() {
    let addr = default_model();
    let history = |result: Value| {
        json!({"messages": [
            {"role": "user", "content": "Show me window 3."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_9", "type": "function",
                "function": {"name": "take_screenshot", "arguments": "{\"window\": 3}"}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": result}],
            "tools": [screenshot()], "max_tokens": 24, "temperature": 0})
    };
    let text = ok(addr, "/v1/chat/completions", &history(json!("no window 3")));
    let image = ok(
        addr,
        "/v1/chat/completions",
        &history(
            json!([{"type": "text", "text": "Screenshot:"}, {"type": "image_url", "image_url": {"url": image_url()}}]),
        ),
    );
    let (pt, pi) =
        (text["usage"]["prompt_tokens"].as_u64().expect("n"), image["usage"]["prompt_tokens"].as_u64().expect("n"));
    assert!(pi > pt + 4, "the image in the tool result is expanded into its placeholder rows ({pt} vs {pi})");
    for v in [&text, &image] {
        assert!(["stop", "length", "tool_calls"].contains(&v["choices"][0]["finish_reason"].as_str().unwrap_or("")));
    }
    // The default model answers the screenshot like its training image question.
    let mut described = history(json!([{"type": "image_url", "image_url": {"url": image_url()}}]));
    described["tool_choice"] = "none".into();
    assert_eq!(ok(addr, "/v1/chat/completions", &described)["choices"][0]["finish_reason"], "stop");
}

fn schemas() -> Vec<Value> {
    let obj = |props: Value, req: Value| json!({"type": "object", "properties": props, "required": req, "additionalProperties": false});
    vec![
        obj(json!({"ok": {"type": "boolean"}}), json!(["ok"])),
        obj(json!({"color": {"enum": ["red", "green", "blue"]}}), json!(["color"])),
        obj(json!({"n": {"type": "integer", "minimum": 3, "maximum": 9}}), json!(["n"])),
        obj(json!({"x": {"type": "number", "minimum": -1, "maximum": 1}}), json!(["x"])),
        obj(json!({"name": {"type": "string", "minLength": 1, "maxLength": 8}}), json!(["name"])),
        obj(
            json!({"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4}}),
            json!(["xs"]),
        ),
        obj(
            json!({"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": false}}),
            json!(["point"]),
        ),
        obj(json!({"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 5}}), json!(["a"])),
        json!({"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3}),
        json!({"enum": [1, 2, 3]}),
        obj(json!({"v": {"const": "fixed"}}), json!(["v"])),
        json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "boolean"}]}),
        obj(json!({"nothing": {"type": "null"}}), json!(["nothing"])),
        json!({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 3}, "tag": {"enum": ["a", "b"]}}, "required": ["id", "tag"], "additionalProperties": false}, "minItems": 1, "maxItems": 2}),
        obj(
            json!({"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"], "additionalProperties": false}}, "required": ["b"], "additionalProperties": false}}),
            json!(["a"]),
        ),
        obj(json!({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}), json!(["code"])),
        obj(json!({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}), json!(["p"])),
        obj(json!({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 3}}), json!(["v"])),
        json!({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["x"], "additionalProperties": false}},
            "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"], "additionalProperties": false}),
        obj(
            json!({"title": {"type": "string", "maxLength": 10}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "rating": {"type": "number", "minimum": 0, "maximum": 5}, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "sci-fi"]}, "maxItems": 2},
            "seen": {"type": "boolean"}}),
            json!(["title", "year", "genres", "seen"]),
        ),
    ]
}

#[test]
fn schema_constrained_output_validates_on_both_models() {
    let schemas = schemas();
    assert!(schemas.len() >= 20);
    for addr in [default_model(), random_model()] {
        for (i, schema) in schemas.iter().enumerate() {
            for temperature in [0.0, 1.0] {
                let body = json!({"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 200,
                    "temperature": temperature, "seed": i,
                    "response_format": {"type": "json_schema", "json_schema": {"name": format!("s{i}"), "schema": schema, "strict": true}}});
                let v = ok(addr, "/v1/chat/completions", &body);
                // Even digits that could run on are wrapped up inside max_tokens: every answer ends.
                assert_eq!(v["choices"][0]["finish_reason"], "stop", "schema {i} at t={temperature}: {v}");
                let text = v["choices"][0]["message"]["content"].as_str().expect("content");
                let out: Value =
                    serde_json::from_str(text).unwrap_or_else(|e| panic!("schema {i}: {text:?} is not JSON: {e}"));
                assert!(validates(schema, &out), "schema {i} at t={temperature}: {out} does not validate");
            }
        }
        let v = ok(
            addr,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "JSON please"}],
            "max_tokens": 200, "temperature": 0, "response_format": {"type": "json_object"}}),
        );
        let text = v["choices"][0]["message"]["content"].as_str().expect("content");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert!(serde_json::from_str::<Value>(text).expect("JSON").is_object(), "{text}");
        // A budget below the shortest answer the schema allows is refused up front (it could only end
        // with `length` and invalid JSON), naming the shortest.
        let body = json!({"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 3,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schemas[14]}}});
        let (s, e) = post(addr, "/v1/chat/completions", &body.to_string(), None);
        assert_eq!((s, e["error"]["param"].as_str()), (400, Some("max_tokens")), "{e}");
        assert!(e["error"]["message"].as_str().is_some_and(|m| m.contains("shortest answer")), "{e}");
    }
}

/// The text of a Responses output's items of `kind` (`message` or `reasoning`).
/// A Responses `output` without its ids (item and call ids differ from run to run).
fn without_ids(o: &Value) -> Vec<Value> {
    o.as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|mut i| {
            if let Some(m) = i.as_object_mut() {
                m.remove("id");
                m.remove("call_id");
            }
            i
        })
        .collect()
}

fn output_text(v: &Value, kind: &str) -> String {
    let items = v["output"].as_array().expect("output");
    let parts =
        items.iter().filter(|i| i["type"] == kind).flat_map(|i| i["content"].as_array().cloned().unwrap_or_default());
    parts.filter_map(|c| c["text"].as_str().map(str::to_string)).collect()
}

/// `(reasoning, text, prompt tokens)` of a chat completion.
fn chat_answer(addr: SocketAddr, body: &Value) -> (String, String, u64) {
    let v = ok(addr, "/v1/chat/completions", body);
    let m = &v["choices"][0]["message"];
    (
        m["reasoning_content"].as_str().unwrap_or_default().to_string(),
        m["content"].as_str().unwrap_or_default().to_string(),
        v["usage"]["prompt_tokens"].as_u64().expect("usage"),
    )
}

#[test]
fn responses_and_messages_give_the_chat_tokens_for_text_and_an_image() {
    for addr in [default_model(), random_model()] {
        let parts = [
            (json!("Describe a red square."), json!("Describe a red square."), json!("Describe a red square.")),
            (
                json!([{"type": "image_url", "image_url": {"url": image_url()}}, {"type": "text", "text": "What is this?"}]),
                json!([{"type": "input_image", "image_url": image_url()}, {"type": "input_text", "text": "What is this?"}]),
                json!([{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                    "data": image_url().split_once(',').map(|x| x.1.to_string()).unwrap_or_default()}},
                    {"type": "text", "text": "What is this?"}]),
            ),
        ];
        for (chat_c, resp_c, msg_c) in parts {
            // Responses (reasoning on, the template's default) vs chat completions with the same default.
            let (r, t, n) = chat_answer(
                addr,
                &json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": chat_c.clone()}], "max_tokens": 24, "temperature": 0}),
            );
            let v = ok(
                addr,
                "/v1/responses",
                &json!({"instructions": "Be brief.", "input": [{"role": "user", "content": resp_c}], "max_output_tokens": 24, "temperature": 0}),
            );
            let text = output_text(&v, "message");
            let reasoning = output_text(&v, "reasoning");
            assert_eq!(
                (reasoning.trim(), text.as_str(), v["usage"]["input_tokens"].as_u64().expect("usage")),
                (r.as_str(), t.as_str(), n),
                "responses: {v}"
            );
            // Messages (thinking off unless asked) vs chat completions with enable_thinking false.
            let (_, t, n) = chat_answer(
                addr,
                &json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": chat_c}], "max_tokens": 24, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}),
            );
            let body = json!({"model": "ignored-by-anthropic-clients-is-checked", "system": "Be brief.", "messages": [{"role": "user", "content": msg_c}], "max_tokens": 24, "temperature": 0});
            let mut body = body;
            body.as_object_mut().expect("object").remove("model");
            let v = ok(addr, "/v1/messages", &body);
            let text: String =
                v["content"].as_array().expect("content").iter().filter_map(|b| b["text"].as_str()).collect();
            let u = &v["usage"];
            let input =
                u["input_tokens"].as_u64().expect("usage") + u["cache_read_input_tokens"].as_u64().expect("usage");
            assert_eq!((text.as_str(), input), (t.as_str(), n), "messages: {v}");
            let counted = ok(addr, "/v1/messages/count_tokens", &body);
            assert_eq!(counted["input_tokens"].as_u64(), Some(n));
        }
    }
}

#[test]
fn thinking_blocks_and_reasoning_items_carry_the_think_text() {
    // The random model thinks until max_tokens; the default one closes its thinking at once. Either way
    // the thinking block / reasoning item holds what chat's reasoning_content holds, and the metrics
    // count each front end.
    for addr in [random_model(), default_model()] {
        let q = json!([{"role": "user", "content": "Describe a red square."}]);
        let (r, t, _) = chat_answer(
            addr,
            &json!({"messages": q, "max_tokens": 20, "temperature": 0, "chat_template_kwargs": {"enable_thinking": true}}),
        );
        let v = ok(
            addr,
            "/v1/messages",
            &json!({"messages": q, "max_tokens": 20, "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        );
        let blocks = v["content"].as_array().expect("content");
        let thinking: String =
            blocks.iter().filter(|b| b["type"] == "thinking").filter_map(|b| b["thinking"].as_str()).collect();
        let text: String = blocks.iter().filter(|b| b["type"] == "text").filter_map(|b| b["text"].as_str()).collect();
        assert_eq!((thinking.trim(), text.as_str()), (r.as_str(), t.as_str()), "{v}");
        if addr == random_model() {
            assert!(!r.is_empty(), "the random model thinks");
            assert_eq!(blocks[0]["type"], "thinking", "thinking comes first");
        }
        let resp = ok(
            addr,
            "/v1/responses",
            &json!({"input": "Describe a red square.", "max_output_tokens": 20, "temperature": 0}),
        );
        let reasoning = output_text(&resp, "reasoning");
        assert_eq!(reasoning.trim(), r, "{resp}");
        assert!(harness::metric(addr, "osprey_requests_total{endpoint=\"messages\"}") >= 1.0);
        assert!(harness::metric(addr, "osprey_requests_total{endpoint=\"responses\"}") >= 1.0);
    }
}

#[test]
fn streams_of_responses_and_messages_add_up_to_the_whole() {
    let addr = default_model();
    let body = json!({"input": "Describe a red square.", "max_output_tokens": 16, "temperature": 0});
    let whole = ok(addr, "/v1/responses", &body);
    let mut s = body.clone();
    s["stream"] = true.into();
    let events: Vec<Value> =
        sse(addr, "/v1/responses", &s).iter().map(|d| serde_json::from_str(d).expect("event")).collect();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(&kinds[..2], ["response.created", "response.in_progress"]);
    assert!(["response.completed", "response.incomplete"].contains(kinds.last().expect("events")));
    let seq: Vec<u64> = events.iter().filter_map(|e| e["sequence_number"].as_u64()).collect();
    assert_eq!(seq, (0..events.len() as u64).collect::<Vec<_>>(), "sequence numbers count up from 0");
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    let last = &events.last().expect("last")["response"];
    assert_eq!(
        without_ids(&last["output"]),
        without_ids(&whole["output"]),
        "the completed event holds the whole output"
    );
    let text = output_text(&whole, "message");
    assert_eq!(deltas, text);
    // Messages: message_start … message_stop, text deltas adding up to the whole message.
    let body = json!({"messages": [{"role": "user", "content": "Describe a red square."}], "max_tokens": 16, "temperature": 0});
    let whole = ok(addr, "/v1/messages", &body);
    let mut s = body.clone();
    s["stream"] = true.into();
    let events: Vec<Value> =
        sse(addr, "/v1/messages", &s).iter().map(|d| serde_json::from_str(d).expect("event")).collect();
    assert_eq!(events.first().expect("events")["type"], "message_start");
    assert_eq!(events.last().expect("events")["type"], "message_stop");
    let text: String = events
        .iter()
        .filter(|e| e["delta"]["type"] == "text_delta")
        .filter_map(|e| e["delta"]["text"].as_str())
        .collect();
    assert_eq!(text, whole["content"][0]["text"].as_str().unwrap_or_default());
    let delta = events.iter().find(|e| e["type"] == "message_delta").expect("message_delta");
    assert_eq!(delta["delta"]["stop_reason"], whole["stop_reason"]);
}

/// Issue 39: a streamed answer with tool calls says what the whole answer says — content (the whole
/// answer's `null` is no content at all, not a newline), calls and finish reason — on chat, Responses and
/// Messages; with the random model (text around its calls) and the trained one, parallel calls on and off.
#[test]
fn streamed_tool_calls_equal_whole_answers_on_every_front_end() {
    for (addr, parallel) in [(default_model(), true), (random_model(), true), (random_model(), false)] {
        let prompt = "What is the weather in Paris?";
        chat_stream_equals_whole(addr, prompt, parallel);
        responses_stream_equals_whole(addr, prompt, parallel);
        messages_stream_equals_whole(addr, prompt, parallel);
    }
}

/// `body` streamed on `path`: its events as JSON, `[DONE]` left out.
fn stream_events(addr: SocketAddr, path: &str, body: &Value) -> Vec<Value> {
    let mut s = body.clone();
    s["stream"] = true.into();
    sse(addr, path, &s).iter().filter(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).expect("event")).collect()
}

/// Chat: the content, the calls rebuilt from their deltas and the finish reason equal the whole answer's.
fn chat_stream_equals_whole(addr: SocketAddr, prompt: &str, parallel: bool) {
    let body = json!({"messages": [{"role": "user", "content": prompt}], "tools": [weather(), screenshot()],
        "tool_choice": "required", "parallel_tool_calls": parallel, "max_tokens": 160, "temperature": 0});
    let whole = ok(addr, "/v1/chat/completions", &body);
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<(String, String)>::new(), Value::Null);
    for c in stream_events(addr, "/v1/chat/completions", &body) {
        let ch = &c["choices"][0];
        content.push_str(ch["delta"]["content"].as_str().unwrap_or_default());
        for tc in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().expect("index") as usize;
            if i == calls.len() {
                calls.push((tc["function"]["name"].as_str().expect("name").into(), String::new()));
            }
            calls[i].1.push_str(tc["function"]["arguments"].as_str().unwrap_or_default());
        }
        if !ch["finish_reason"].is_null() {
            finish = ch["finish_reason"].clone();
        }
    }
    let m = &whole["choices"][0]["message"];
    assert_eq!(content, m["content"].as_str().unwrap_or_default(), "chat content: {whole}");
    let whole_calls: Vec<(String, String)> = m["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["function"]["name"].as_str().unwrap_or_default().into(),
                c["function"]["arguments"].as_str().unwrap_or_default().into(),
            )
        })
        .collect();
    assert_eq!(calls, whole_calls, "chat calls");
    assert_eq!(finish, whole["choices"][0]["finish_reason"]);
}

/// Responses: the completed event's output is the whole output, and the text deltas its text.
fn responses_stream_equals_whole(addr: SocketAddr, prompt: &str, parallel: bool) {
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": weather()["function"]["parameters"]}]);
    let body = json!({"input": prompt, "tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel,
        "max_output_tokens": 160, "temperature": 0});
    let whole = ok(addr, "/v1/responses", &body);
    let events = stream_events(addr, "/v1/responses", &body);
    let last = &events.last().expect("events")["response"];
    assert_eq!(without_ids(&last["output"]), without_ids(&whole["output"]), "responses output");
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(text, output_text(&whole, "message"), "responses text");
}

/// Messages: text and tool_use blocks rebuilt from the deltas equal the whole answer's, and the stop reason.
fn messages_stream_equals_whole(addr: SocketAddr, prompt: &str, parallel: bool) {
    let tool = json!({"name": "get_weather", "input_schema": weather()["function"]["parameters"]});
    let body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 160, "temperature": 0,
        "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": !parallel}});
    let whole = ok(addr, "/v1/messages", &body);
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut stop = Value::Null;
    for e in stream_events(addr, "/v1/messages", &body) {
        match e["type"].as_str() {
            Some("content_block_start") => {
                let b = &e["content_block"];
                let name = b["name"].as_str().unwrap_or_default();
                blocks.push((format!("{}{name}", b["type"].as_str().unwrap_or_default()), String::new()));
            }
            Some("content_block_delta") => {
                let d = &e["delta"];
                let piece = d["text"].as_str().or_else(|| d["partial_json"].as_str()).unwrap_or_default();
                blocks.last_mut().expect("a block").1.push_str(piece);
            }
            Some("message_delta") => stop = e["delta"]["stop_reason"].clone(),
            _ => {}
        }
    }
    let whole_blocks: Vec<(String, String)> = whole["content"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| match b["type"].as_str() {
            Some("tool_use") => (format!("tool_use{}", b["name"].as_str().unwrap_or_default()), b["input"].to_string()),
            _ => ("text".into(), b["text"].as_str().unwrap_or_default().into()),
        })
        .collect();
    let streamed: Vec<(String, String)> = blocks
        .into_iter()
        .map(|(k, v)| {
            if k.starts_with("tool_use") {
                (k, serde_json::from_str::<Value>(&v).map(|j| j.to_string()).unwrap_or(v))
            } else {
                (k, v)
            }
        })
        .collect();
    assert_eq!(streamed, whole_blocks, "messages content: {whole}");
    assert_eq!(stop, whole["stop_reason"]);
}

#[test]
fn tool_use_through_messages_and_function_calls_through_responses() {
    let addr = default_model();
    let tool = json!({"name": "get_weather", "input_schema": weather()["function"]["parameters"]});
    let v = ok(
        addr,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200,
        "temperature": 0, "tools": [tool], "tool_choice": {"type": "any"}}),
    );
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let use_block =
        v["content"].as_array().expect("content").iter().find(|b| b["type"] == "tool_use").expect("tool_use").clone();
    assert!(validates(&weather()["function"]["parameters"], &use_block["input"]));
    // The result goes back as a tool_result block with an image.
    let data = image_url().split_once(',').map(|x| x.1.to_string()).unwrap_or_default();
    let next = json!({"max_tokens": 16, "temperature": 0, "tools": [tool], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [use_block.clone()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_block["id"], "content": [
            {"type": "text", "text": "radar:"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]}]});
    let v2 = ok(addr, "/v1/messages", &next);
    assert!(
        v2["usage"]["input_tokens"].as_u64().expect("n") + v2["usage"]["cache_read_input_tokens"].as_u64().expect("n")
            > v["usage"]["input_tokens"].as_u64().expect("n") + 20
    );
    // Responses: a forced function call, its output sent back with previous_response_id.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": weather()["function"]["parameters"]}]);
    let r = ok(
        addr,
        "/v1/responses",
        &json!({"input": "Weather in Paris?", "tools": tools, "tool_choice": "required", "max_output_tokens": 200, "temperature": 0}),
    );
    let call = r["output"]
        .as_array()
        .expect("output")
        .iter()
        .find(|i| i["type"] == "function_call")
        .expect("function_call")
        .clone();
    let args: Value = serde_json::from_str(call["arguments"].as_str().expect("arguments")).expect("JSON");
    assert!(validates(&weather()["function"]["parameters"], &args));
    let follow = ok(
        addr,
        "/v1/responses",
        &json!({"previous_response_id": r["id"], "tools": tools, "max_output_tokens": 8, "temperature": 0,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}]}),
    );
    // The follow-up continues the stored conversation: its prompt holds the first one, cached.
    assert!(follow["usage"]["input_tokens"].as_u64() > r["usage"]["input_tokens"].as_u64());
    assert!(follow["usage"]["input_tokens_details"]["cached_tokens"].as_u64().expect("cached") > 0, "{follow}");
}

#[test]
fn previous_response_id_continues_and_store_false_is_honoured() {
    let addr = default_model();
    let first = ok(
        addr,
        "/v1/responses",
        &json!({"input": "Describe a red square.", "max_output_tokens": 12, "temperature": 0, "reasoning": {"effort": "none"}}),
    );
    let answer = output_text(&first, "message");
    let second = ok(
        addr,
        "/v1/responses",
        &json!({"previous_response_id": first["id"], "input": "And a blue one?", "max_output_tokens": 12, "temperature": 0, "reasoning": {"effort": "none"}}),
    );
    let (_, t, n) = chat_answer(
        addr,
        &json!({"messages": [{"role": "user", "content": "Describe a red square."},
        {"role": "assistant", "content": answer.trim()}, {"role": "user", "content": "And a blue one?"}],
        "max_tokens": 12, "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let text = output_text(&second, "message");
    assert_eq!((text, second["usage"]["input_tokens"].as_u64()), (t, Some(n)), "{second}");
    let (s, got) = harness::get(addr, &format!("/v1/responses/{}", first["id"].as_str().expect("id")));
    assert_eq!(s, 200, "{got}");
    let unstored = ok(addr, "/v1/responses", &json!({"input": "hi", "max_output_tokens": 2, "store": false}));
    let (s, e) = post(
        addr,
        "/v1/responses",
        &json!({"previous_response_id": unstored["id"], "input": "again"}).to_string(),
        None,
    );
    assert_eq!((s, e["error"]["code"].as_str()), (404, Some("response_not_found")));
}

#[test]
fn every_new_refusal_has_its_code() {
    let addr = default_model();
    chat_refusals_have_their_codes(addr);
    responses_and_messages_refusals_have_their_codes(addr);
}

/// Chat: unsupported tools and formats, bad schemas and arguments, oversized tools and schemas.
fn chat_refusals_have_their_codes(addr: SocketAddr) {
    let user = json!([{"role": "user", "content": "hi"}]);
    let chat_cases = [
        (json!({"messages": user, "tools": [{"type": "retrieval"}]}), 400, "unsupported_parameter"),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "bad name"}}]}),
            400,
            "invalid_request",
        ),
        (
            json!({"messages": user, "tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            400,
            "invalid_request",
        ),
        (json!({"messages": user, "tool_choice": "required"}), 400, "invalid_request"),
        (json!({"messages": user, "tools": [weather()], "tool_choice": "sometimes"}), 400, "invalid_request"),
        (
            json!({"messages": user, "tools": [weather()], "tool_choice": "required", "response_format": {"type": "json_object"}}),
            400,
            "unsupported_parameter",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": true}}),
            400,
            "unsupported_parameter",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}, "strict": true}}}),
            400,
            "invalid_schema",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 7}}}),
            400,
            "invalid_schema",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
            400,
            "invalid_request",
        ),
        // Tools count with the prompt's text (they are rendered into it), refused before the template runs.
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "description": "word ".repeat(400_000)}}]}),
            400,
            "context_length_exceeded",
        ),
        (
            json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": "x".repeat(300_000)}}}}),
            400,
            "invalid_schema",
        ),
    ];
    for (body, status, code) in &chat_cases {
        let (s, e) = post(addr, "/v1/chat/completions", &body.to_string(), None);
        assert_eq!((s, e["error"]["code"].as_str()), (*status, Some(*code)), "{body}: {e}");
        if *code == "context_length_exceeded" {
            let m = e["error"]["message"].as_str().unwrap_or_default();
            assert!(m.contains("bytes of text"), "refused by size before tokenization: {m}");
        }
    }
}

/// Responses (OpenAI's envelope) and Messages (Anthropic's envelope).
fn responses_and_messages_refusals_have_their_codes(addr: SocketAddr) {
    let user = json!([{"role": "user", "content": "hi"}]);
    let resp_cases = [
        (json!({"input": "hi", "previous_response_id": "resp_nope"}), 404, "response_not_found"),
        (json!({"input": [{"type": "web_search_call"}]}), 400, "unsupported_parameter"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}),
            400,
            "unsupported_parameter",
        ),
        (json!({"input": "hi", "tools": [{"type": "web_search"}]}), 400, "unsupported_parameter"),
        (json!({"input": "hi", "background": true}), 400, "unsupported_parameter"),
        (json!({"instructions": "x"}), 400, "invalid_request"),
    ];
    for (body, status, code) in &resp_cases {
        let (s, e) = post(addr, "/v1/responses", &body.to_string(), None);
        assert_eq!((s, e["error"]["code"].as_str()), (*status, Some(*code)), "{body}: {e}");
    }
    let (s, _) = harness::get(addr, "/v1/responses/resp_nope");
    assert_eq!(s, 404);
    // Messages errors come in Anthropic's envelope.
    let msg_cases = [
        (json!({"messages": user}), 400, "invalid_request_error"),
        (json!({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}), 400, "invalid_request_error"),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]}),
            400,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}}]}]}),
            400,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 4, "messages": user, "tools": [{"type": "web_search_20250305", "name": "s"}]}),
            400,
            "invalid_request_error",
        ),
        (json!({"max_tokens": 4, "messages": user, "model": "claude-x"}), 404, "not_found_error"),
    ];
    for (body, status, kind) in &msg_cases {
        let (s, e) = post(addr, "/v1/messages", &body.to_string(), None);
        assert_eq!(
            (s, e["type"].as_str(), e["error"]["type"].as_str()),
            (*status, Some("error"), Some(*kind)),
            "{body}: {e}"
        );
        assert!(e["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
}

#[test]
fn api_keys_apply_to_every_front_end() {
    let addr = start(
        Settings { api_key: Some("sekret".into()), ..exact() },
        osprey::model_dir(&Settings::default()).expect("default model"),
    );
    let msg = json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (s, e) = post(addr, "/v1/messages", &msg, None);
    assert_eq!((s, e["error"]["type"].as_str()), (401, Some("authentication_error")));
    let r = ureq::post(&format!("http://{addr}/v1/messages"))
        .set("content-type", "application/json")
        .set("x-api-key", "sekret")
        .send_string(&msg)
        .expect("x-api-key accepted");
    assert_eq!(r.status(), 200);
    let (s, _) = post(addr, "/v1/responses", &json!({"input": "hi", "max_output_tokens": 2}).to_string(), None);
    assert_eq!(s, 401);
    let (s, _) =
        post(addr, "/v1/responses", &json!({"input": "hi", "max_output_tokens": 2}).to_string(), Some("sekret"));
    assert_eq!(s, 200);
}
