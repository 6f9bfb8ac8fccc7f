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
