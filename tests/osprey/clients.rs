//! The requests the OpenAI and Anthropic SDK helpers, LiteLLM, LangChain, instructor and pydantic-ai send
//! (issue 22), raw, over real HTTP against the embedded default model: each failed against the server
//! before its fix. `tools/client_compat.py` drives the libraries themselves (by hand; no Python here).

use crate::harness;

use std::net::SocketAddr;
use std::sync::OnceLock;

use harness::{get, post};
use osprey::Settings;
use serde_json::{json, Value};

fn server() -> SocketAddr {
    static S: OnceLock<SocketAddr> = OnceLock::new();
    *S.get_or_init(|| {
        let settings = Settings::default();
        let dir = osprey::model_dir(&settings).expect("embedded default model");
        harness::start(settings, dir)
    })
}

fn model_id() -> String {
    let (_, body) = get(server(), "/v1/models");
    serde_json::from_str::<Value>(&body).expect("json")["data"][0]["id"].as_str().expect("id").to_string()
}

/// `client.models.retrieve(id)` in both SDKs: `GET /v1/models/{id}`.
#[test]
fn models_retrieve_serves_the_model_object_in_both_shapes() {
    let id = model_id();
    let (s, body) = get(server(), &format!("/v1/models/{id}"));
    assert_eq!(s, 200, "{body}");
    let m: Value = serde_json::from_str(&body).expect("json");
    // OpenAI's Model and Anthropic's ModelInfo.
    assert_eq!(
        (m["id"].as_str(), m["object"].as_str(), m["owned_by"].as_str()),
        (Some(id.as_str()), Some("model"), Some("osprey"))
    );
    assert!(m["created"].is_u64());
    assert_eq!((m["type"].as_str(), m["display_name"].as_str()), (Some("model"), Some(id.as_str())));
    assert!(m["created_at"].as_str().is_some_and(|t| t.ends_with('Z') && t.len() == 20), "{m}");
    let (s, body) = get(server(), "/v1/models/gpt-4o");
    let e: Value = serde_json::from_str(&body).expect("json");
    assert_eq!((s, e["error"]["code"].as_str()), (404, Some("model_not_found")), "{e}");
}

/// Anthropic's `messages.parse` and `ChatAnthropic.with_structured_output(method="json_schema")` send
/// `output_config.format` (older clients: `output_format`); it was ignored.
#[test]
fn anthropic_structured_outputs_constrain_the_answer() {
    let schema = json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"], "additionalProperties": false});
    for key in ["output_config", "output_format"] {
        let format = json!({"type": "json_schema", "schema": schema});
        let mut body = json!({"max_tokens": 32, "messages": [{"role": "user", "content": "Describe a red circle."}]});
        body[key] = if key == "output_config" { json!({"format": format}) } else { format };
        let (s, v) = post(server(), "/v1/messages", &body.to_string(), None);
        assert_eq!(s, 200, "{v}");
        let text = v["content"][0]["text"].as_str().expect("text");
        let answer: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{key}: not JSON ({e}): {text}"));
        assert!(["red", "green", "blue"].contains(&answer["color"].as_str().unwrap_or("")), "{key}: {answer}");
    }
}

/// A last assistant message is continued (Anthropic's prefill), not closed and restarted.
#[test]
fn an_assistant_prefill_is_continued() {
    let prefill = "a red";
    let (s, v) = post(
        server(),
        "/v1/messages",
        &json!({"max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": "Describe a red circle."},
            {"role": "assistant", "content": prefill}]})
        .to_string(),
        None,
    );
    assert_eq!(s, 200, "{v}");
    let cont = v["content"][0]["text"].as_str().expect("text").to_string();
    assert!(!cont.starts_with(prefill), "the answer is the continuation only: {cont:?}");
    // The same continuation through chat completions' `continue_final_message` (vLLM's extension).
    let chat = |extra: Value| {
        let mut body = json!({"max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": "Describe a red circle."},
            {"role": "assistant", "content": prefill}]});
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        post(server(), "/v1/chat/completions", &body.to_string(), None)
    };
    let (s, c) = chat(json!({"continue_final_message": true, "chat_template_kwargs": {"enable_thinking": false}}));
    assert_eq!(s, 200, "{c}");
    assert_eq!(c["choices"][0]["message"]["content"].as_str(), Some(cont.as_str()), "{c}");
    // Without it, a new turn begins after the closed assistant message: another prompt.
    let (_, plain) = chat(json!({"chat_template_kwargs": {"enable_thinking": false}}));
    assert_ne!(
        plain["usage"]["prompt_tokens"], c["usage"]["prompt_tokens"],
        "continuing drops the end of turn and the generation prompt"
    );
    let (s, e) = chat(json!({"continue_final_message": true, "add_generation_prompt": true}));
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("add_generation_prompt")), "{e}");
}

/// `deadline_secs` applies on every front end, not only chat completions.
#[test]
fn deadline_secs_applies_to_responses_and_messages() {
    let long = "Tell me a long story. ".repeat(50);
    let r = json!({"input": long, "max_output_tokens": 3000, "deadline_secs": 0.000_001});
    let (s, v) = post(server(), "/v1/responses", &r.to_string(), None);
    assert_eq!(s, 504, "{v}");
    let m = json!({"max_tokens": 3000, "deadline_secs": 0.000_001, "messages": [{"role": "user", "content": long}]});
    let (s, v) = post(server(), "/v1/messages", &m.to_string(), None);
    assert_eq!(s, 504, "{v}");
}

/// `ChatAnthropic` sends `max_tokens: 4096`, the embedded model's whole context: clamped to what the
/// context leaves, and the answer ends with `max_tokens` if it runs there.
#[test]
fn max_tokens_beyond_the_context_is_clamped_to_what_is_left() {
    let (s, v) = post(
        server(),
        "/v1/messages",
        &json!({"max_tokens": 4096, "messages": [{"role": "user", "content": "Hello!"}]}).to_string(),
        None,
    );
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(
        server(),
        "/v1/chat/completions",
        &json!({"max_tokens": 100_000, "ignore_eos": true, "messages": [{"role": "user", "content": "Hello!"}]})
            .to_string(),
        None,
    );
    assert_eq!(s, 200, "{v}");
    let (p, c) = (
        v["usage"]["prompt_tokens"].as_u64().expect("usage"),
        v["usage"]["completion_tokens"].as_u64().expect("usage"),
    );
    assert_eq!(p + c, 4096, "generated up to the end of the context");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

fn validates(schema: &Value, v: &Value) -> bool {
    jsonschema::validator_for(schema).expect("a valid schema").is_valid(v)
}

/// The shortest answer a format allows, as the server reports it when `max_tokens` is below it.
fn shortest(body: &Value) -> u64 {
    let mut b = body.clone();
    b["max_tokens"] = json!(1);
    let (s, e) = post(server(), "/v1/chat/completions", &b.to_string(), None);
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("max_tokens")), "{e}");
    let msg = e["error"]["message"].as_str().expect("message");
    msg.rsplit('(').next().and_then(|t| t.split_whitespace().next()).and_then(|n| n.parse().ok()).expect(msg)
}

/// Issue 22, item 2: structured output that runs out of budget inside a string was not JSON
/// (`{"description": "... a red}}}}}}`). Every answer of the sweep, schemas × budgets from the shortest
/// answer up, parses and validates.
#[test]
fn structured_output_validates_at_every_budget_from_the_shortest_up() {
    let schemas = [
        json!({"type": "object", "properties": {"description": {"type": "string"}}, "required": ["description"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"shapes": {"type": "array", "minItems": 1, "items": {"type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}, "name": {"type": "string"}}, "required": ["color", "name"],
            "additionalProperties": false}}, "count": {"type": "integer", "minimum": 0}}, "required": ["shapes", "count"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}, "confidence": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["answer", "confidence", "tags"], "additionalProperties": false}),
    ];
    let mut answers = 0;
    for schema in &schemas {
        let body = json!({"messages": [{"role": "user", "content": "Describe the image."}], "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "Desc", "strict": true, "schema": schema}}});
        let from = shortest(&body);
        for budget in from..from + 40 {
            let mut b = body.clone();
            b["max_tokens"] = json!(budget);
            let (s, v) = post(server(), "/v1/chat/completions", &b.to_string(), None);
            assert_eq!(s, 200, "{v}");
            let text = v["choices"][0]["message"]["content"].as_str().expect("content");
            let answer: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{schema} at {budget}: not JSON ({e}): {text}"));
            assert!(validates(schema, &answer), "{schema} at {budget}: {text}");
            assert!(v["usage"]["completion_tokens"].as_u64().expect("usage") <= budget);
            answers += 1;
        }
    }
    assert_eq!(answers, 120);
}

/// Issue 40, item 2: a forced call can end in raw text when the model opens an optional parameter (a
/// choice made by letters: `<p` for `<parameter=tags>`, `</` for `</function>`) the budget cannot close.
/// Three tool shapes (an enum, a bounded integer and an optional array; a nested object and an optional
/// string; an array of objects), each at every budget from the shortest call up 75 more, sampled with a
/// seed per budget (the default temperature, as the clients): every answer is one parsed call whose
/// arguments validate, ending `tool_calls`. Before the fix 45 of the 228 ended `length` in raw text.
#[test]
fn forced_calls_close_at_every_budget_from_the_shortest_up() {
    let shapes = [
        json!({"name": "get_shape", "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}}, "required": ["color", "n"]}}),
        json!({"name": "find_place", "parameters": {"type": "object", "properties": {"place": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
            "required": ["city"], "additionalProperties": false}, "when": {"type": "string", "maxLength": 10}}, "required": ["place"]}}),
        json!({"name": "order", "parameters": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3,
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
            "qty": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["name", "qty"], "additionalProperties": false}},
            "note": {"type": "string", "maxLength": 20}}, "required": ["items"]}}),
    ];
    let mut answers = 0;
    for shape in &shapes {
        let body = json!({"messages": [{"role": "user", "content": "Call the tool."}], "tools": [{"type": "function", "function": shape}],
            "tool_choice": "required", "parallel_tool_calls": false});
        let from = shortest(&body);
        for budget in from..=from + 75 {
            let mut b = body.clone();
            b["max_tokens"] = json!(budget);
            b["seed"] = json!(budget);
            let (s, v) = post(server(), "/v1/chat/completions", &b.to_string(), None);
            assert_eq!(s, 200, "{v}");
            let choice = &v["choices"][0];
            assert_eq!(choice["finish_reason"], "tool_calls", "{} at {budget}: {choice}", shape["name"]);
            let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
            assert_eq!(calls.len(), 1, "{choice}");
            let args: Value =
                serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("arguments")).expect("json");
            assert!(validates(&shape["parameters"], &args), "{} at {budget}: {args}", shape["name"]);
            assert!(v["usage"]["completion_tokens"].as_u64().expect("usage") <= budget);
            answers += 1;
        }
    }
    assert_eq!(answers, 228);
}

/// Issue 40, item 3: `{"type": "integer", "multipleOf": 7, "minimum": 1}` at `max_tokens` 16 gave
/// `2001001001001001` and `length`: the closing walk took the lowest digit, and `0`, `1` never make a
/// multiple of 7 again. Now the number ends inside the budget and is a multiple of 7 (checked on its
/// digits: a sampled 12-digit answer is past what f64 checks exactly).
#[test]
fn a_number_with_a_step_stops_in_time_and_satisfies_its_schema() {
    let schema = json!({"type": "integer", "multipleOf": 7, "minimum": 1});
    for (budget, seed) in [16, 32, 200].into_iter().flat_map(|b| (0..4).map(move |s| (b, s))) {
        let body = json!({"messages": [{"role": "user", "content": "A number?"}], "max_tokens": budget, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true, "schema": schema}}});
        let (s, v) = post(server(), "/v1/chat/completions", &body.to_string(), None);
        assert_eq!(s, 200, "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().expect("content");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "at {budget}/{seed}: {text}");
        assert!(text.bytes().all(|b| b.is_ascii_digit()) && !text.starts_with('0'), "at {budget}/{seed}: {text:?}");
        let rest = text.bytes().fold(0u32, |r, d| (r * 10 + u32::from(d - b'0')) % 7);
        assert_eq!(rest, 0, "at {budget}/{seed}: {text} is not a multiple of 7");
    }
}

/// Issue 22, item 2: a forced call of three parameters once needed 78 tokens and was cut at 64.
#[test]
fn a_forced_three_parameter_call_fits_a_small_budget() {
    let tools = json!([{"type": "function", "function": {"name": "plan_trip", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["city", "days", "tags"]}}}]);
    let body = json!({"messages": [{"role": "user", "content": "Plan a trip to Paris."}], "tools": tools,
        "tool_choice": "required", "temperature": 0});
    let from = shortest(&body);
    for budget in [from, from + 5, from + 20, 96] {
        let mut b = body.clone();
        b["max_tokens"] = json!(budget);
        let (s, v) = post(server(), "/v1/chat/completions", &b.to_string(), None);
        assert_eq!(s, 200, "{v}");
        let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("at {budget}: {v}"));
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("arguments")).expect("json");
        assert!(validates(&tools[0]["function"]["parameters"], &args), "at {budget}: {args}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "at {budget}: {v}");
    }
}
