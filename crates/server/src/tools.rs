//! Function tools: the request side (definitions, `tool_choice`) and the answer side, a streaming parser
//! of the Qwen XML call syntax the chat template teaches the model:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Parameter values are raw text; a value is JSON when the parameter's schema says it is not a string.
//! Arguments are streamed as OpenAI does: a call's id and name first, then fragments of its arguments'
//! JSON that concatenate to the whole. Anything that does not follow the syntax is answered as text.

use std::collections::HashMap;

use osprey_protocol::ErrorCode;
use serde_json::{json, Map, Value};

use crate::error::{invalid, ApiError};
use crate::text::held_suffix;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNC: &str = "<function=";
const FUNC_END: &str = "</function>";
const PARAM: &str = "<parameter=";
const PARAM_END: &str = "</parameter>";
/// Longest function name the parser waits for (tool names are at most 64 characters).
const NAME_MAX: usize = 256;

/// One function tool of a request.
#[derive(Clone, Debug)]
pub struct ToolSpec {
    /// Function name.
    pub name: String,
    /// Description, if given.
    pub description: Option<String>,
    /// JSON Schema of the arguments (an object schema; `{}` when none was given).
    pub parameters: Value,
}

impl ToolSpec {
    /// The OpenAI chat form the template renders (`{"type": "function", "function": {...}}`).
    pub fn template_json(&self) -> Value {
        let mut f = Map::new();
        f.insert("name".into(), self.name.clone().into());
        if let Some(d) = &self.description {
            f.insert("description".into(), d.clone().into());
        }
        f.insert("parameters".into(), self.parameters.clone());
        json!({"type": "function", "function": f})
    }

    /// A parameter's schema, its own `$ref`s followed (`None` for a parameter the schema does not name).
    fn param_schema(&self, param: &str) -> Option<&Value> {
        let declared = self.parameters.get("properties")?.get(param)?;
        Some(crate::schema::follow_refs(&self.parameters, declared))
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call (the answer is text; calls are not parsed).
    None,
    /// The model decides.
    Auto,
    /// At least one call, forced by the grammar.
    Required,
    /// This function, forced by the grammar.
    Named(String),
}

fn check_name(name: &str, param: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!("tool names are 1-64 characters of a-z, A-Z, 0-9, _, - or . (got `{name}`)"), param))
    }
}

/// Builds a tool from its parts (shared by the chat, Responses and Messages forms).
pub fn tool(
    name: Option<&str>,
    description: Option<&str>,
    parameters: Option<&Value>,
    param: &str,
) -> Result<ToolSpec, ApiError> {
    let name = name.ok_or_else(|| invalid("a function tool needs a `name`", param))?;
    check_name(name, param)?;
    let parameters = match parameters {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(invalid("a tool's parameters must be a JSON Schema object", param)),
    };
    // Forced calls compile these into the call grammar: the same bounds as `response_format`.
    crate::schema::check_schema(&parameters, &format!("{param}.parameters"))?;
    Ok(ToolSpec { name: name.to_string(), description: description.map(str::to_string), parameters })
}

/// Parses chat completions' `tools` (`[{"type": "function", "function": {...}}]`).
pub fn parse_chat_tools(tools: Option<&Value>) -> Result<Vec<ToolSpec>, ApiError> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(invalid("tools must be a list", "tools")),
    };
    let mut out: Vec<ToolSpec> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            other => {
                return Err(ApiError::new(
                    ErrorCode::UnsupportedParameter,
                    format!("only function tools are supported (got type {})", crate::error::shown(other)),
                )
                .param(&param))
            }
        }
        let f = t.get("function").ok_or_else(|| invalid("a function tool needs `function`", &param))?;
        let spec = tool(
            f.get("name").and_then(Value::as_str),
            f.get("description").and_then(Value::as_str),
            f.get("parameters"),
            &param,
        )?;
        if out.iter().any(|o| o.name == spec.name) {
            return Err(invalid(format!("two tools are named `{}`", spec.name), &param));
        }
        out.push(spec);
    }
    Ok(out)
}

/// Parses `tool_choice` in the chat form (`"none" | "auto" | "required" | {"type": "function",
/// "function": {"name": ...}}`; the Responses form `{"type": "function", "name": ...}` is accepted too).
pub fn parse_tool_choice(choice: Option<&Value>, tools: &[ToolSpec]) -> Result<ToolChoice, ApiError> {
    let c = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(invalid(format!("tool_choice `{other}` is not none, auto or required"), "tool_choice"))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| v.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    invalid(
                        "tool_choice names a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice",
                    )
                })?;
            ToolChoice::Named(name.to_string())
        }
    };
    named_exists(&c, tools)?;
    if tools.is_empty() && matches!(c, ToolChoice::Required) {
        return Err(invalid("tool_choice `required` needs tools", "tool_choice"));
    }
    Ok(c)
}

/// A named choice must name one of the tools.
pub fn named_exists(c: &ToolChoice, tools: &[ToolSpec]) -> Result<(), ApiError> {
    if let ToolChoice::Named(n) = c {
        if !tools.iter().any(|t| &t.name == n) {
            return Err(invalid(format!("tool_choice names `{n}`, which is not among the tools"), "tool_choice"));
        }
    }
    Ok(())
}

/// An assistant message's past `tool_calls` (arguments as a JSON string, or an object) in the form the
/// template renders: arguments as an object.
pub fn template_calls(calls: &Value, param: &str) -> Result<Value, ApiError> {
    let list = calls.as_array().ok_or_else(|| invalid("tool_calls must be a list", param))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let p = format!("{param}[{i}]");
        let f = c.get("function").ok_or_else(|| invalid("a tool call needs `function`", &p))?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| invalid("a tool call needs a name", &p))?;
        let args = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) if s.trim().is_empty() => json!({}),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
                invalid(format!("tool call arguments are not JSON: {e}"), &format!("{p}.function.arguments"))
            })?,
            Some(v) => v.clone(),
        };
        if !args.is_object() {
            return Err(invalid("tool call arguments must be a JSON object", &format!("{p}.function.arguments")));
        }
        let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
        out.push(json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}));
    }
    Ok(Value::Array(out))
}

/// A call parsed from the answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// `call_…`.
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments as a JSON object's text.
    pub arguments: String,
}

/// What the parser gives for a piece of answer text.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolEvent {
    /// Plain answer text.
    Text(String),
    /// A call begins (its index among the answer's calls).
    Start {
        /// Index.
        index: usize,
        /// Id.
        id: String,
        /// Name.
        name: String,
    },
    /// More of a call's arguments text.
    Args {
        /// Index.
        index: usize,
        /// Fragment.
        fragment: String,
    },
    /// The call is complete (a call that never gets here was cut off).
    End {
        /// Index.
        index: usize,
    },
}

#[derive(Debug)]
enum Phase {
    Text,
    /// After `<tool_call>`: waiting for `<function=NAME>`.
    Function,
    /// Inside `<function=…>`: parameters or `</function>`.
    Params,
    /// After `</function>`: waiting for `</tool_call>`.
    End,
}

/// Streaming parser of the call syntax over the answer text.
#[derive(Debug)]
pub struct ToolParser {
    tools: HashMap<String, ToolSpec>,
    id_prefix: String,
    phase: Phase,
    /// Unparsed text.
    buf: String,
    /// The raw text of the call being parsed (answered as text if it turns out malformed).
    raw: String,
    calls: Vec<Call>,
    /// The current call's arguments so far (an open JSON object).
    args: String,
    started: bool,
    params: usize,
    /// Keep only the first call (`parallel_tool_calls: false`).
    single: bool,
}

fn skip_ws(s: &str) -> &str {
    s.trim_start_matches([' ', '\n', '\r', '\t'])
}

/// Whether `s` could still become `pat` (it is a prefix of it).
fn could_be(s: &str, pat: &str) -> bool {
    s.len() < pat.len() && pat.starts_with(s)
}

impl ToolParser {
    /// A parser for `tools`; call ids are `{id_prefix}{index}`.
    pub fn new(tools: &[ToolSpec], id_prefix: String, parallel: bool) -> Self {
        ToolParser {
            tools: tools.iter().map(|t| (t.name.clone(), t.clone())).collect(),
            id_prefix,
            phase: Phase::Text,
            buf: String::new(),
            raw: String::new(),
            calls: Vec::new(),
            args: String::new(),
            started: false,
            params: 0,
            single: !parallel,
        }
    }

    /// The complete calls so far.
    pub fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// The call being parsed does not follow the syntax: what was taken as its start is answer text,
    /// and the text after it is read again as answer text (it may hold a later, well-formed call).
    fn malformed(&mut self, out: &mut Vec<ToolEvent>) {
        if self.started {
            self.calls.pop();
        }
        self.phase = Phase::Text;
        self.started = false;
        self.args.clear();
        out.push(ToolEvent::Text(std::mem::take(&mut self.raw)));
    }

    fn consume(&mut self, n: usize) {
        let taken: String = self.buf.drain(..n).collect();
        self.raw.push_str(&taken);
    }

    /// A parameter's raw text as its JSON value: text where the call grammar writes raw text (a string
    /// or an enum of strings, `$ref`s followed) or the schema does not name the parameter, else JSON
    /// (text when it does not parse).
    fn value_json(&self, name: &str, param: &str, value: &str) -> Value {
        let schema = self.tools.get(name).and_then(|t| t.param_schema(param));
        let Some(schema) = schema.filter(|s| !crate::schema::raw_text(s)) else {
            return Value::String(value.to_string());
        };
        let integer = schema.get("type").and_then(Value::as_str) == Some("integer");
        match serde_json::from_str(value) {
            // JSON's `-0` parses as the float -0.0; an integer parameter's value is the integer 0.
            Ok(Value::Number(n)) if integer && n.as_f64() == Some(0.0) && n.as_i64().is_none() => 0.into(),
            Ok(v) => v,
            Err(_) => Value::String(value.to_string()),
        }
    }

    /// Feeds answer text; returns what can be said now.
    pub fn feed(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        // Each phase reads what it can and says whether to go on (false: it waits for more text).
        while match self.phase {
            Phase::Text => self.text(&mut out),
            Phase::Function => self.function(&mut out),
            Phase::Params => self.param(&mut out),
            Phase::End => self.end(&mut out),
        } {}
        out
    }

    /// Answer text up to a call's opening tag.
    fn text(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        if self.single && !self.calls.is_empty() {
            // One call was asked for: the rest of the answer is dropped, as a client expects
            // nothing after the call.
            self.buf.clear();
            return false;
        }
        if let Some(i) = self.buf.find(OPEN) {
            let before: String = self.buf.drain(..i).collect();
            if !before.is_empty() {
                out.push(ToolEvent::Text(before));
            }
            self.consume(OPEN.len());
            self.phase = Phase::Function;
            return true;
        }
        let held = held_suffix(&self.buf, &[OPEN]);
        let emit: String = self.buf.drain(..self.buf.len() - held).collect();
        if !emit.is_empty() {
            out.push(ToolEvent::Text(emit));
        }
        false
    }

    /// `<function=name>`.
    fn function(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let rest = skip_ws(&self.buf);
        let ws = self.buf.len() - rest.len();
        if rest.is_empty() || could_be(rest, FUNC) {
            return false;
        }
        if !rest.starts_with(FUNC) {
            self.malformed(out);
            return true;
        }
        // A name is one line of at most NAME_MAX bytes, decided the same way whether its
        // `>` has arrived or not (streamed and whole answers parse alike).
        let Some(end) = rest.find('>') else {
            if rest.contains('\n') || rest.len() > FUNC.len() + NAME_MAX {
                self.malformed(out);
                return true;
            }
            return false;
        };
        let raw_name = &rest[FUNC.len()..end];
        let name = raw_name.trim().to_string();
        if name.is_empty() || raw_name.contains(['<', '\n']) || end > FUNC.len() + NAME_MAX {
            self.malformed(out);
            return true;
        }
        self.consume(ws + end + 1);
        let index = self.calls.len();
        self.started = true;
        self.params = 0;
        self.args = String::from("{");
        out.push(ToolEvent::Start { index, id: format!("{}{index}", self.id_prefix), name: name.clone() });
        self.calls.push(Call { id: format!("{}{index}", self.id_prefix), name, arguments: String::new() });
        self.phase = Phase::Params;
        true
    }

    /// One `<parameter=name>value</parameter>`, or the call's `</function>`.
    fn param(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let rest = skip_ws(&self.buf);
        let ws = self.buf.len() - rest.len();
        if rest.is_empty() || could_be(rest, PARAM) || could_be(rest, FUNC_END) {
            return false;
        }
        if rest.starts_with(FUNC_END) {
            self.consume(ws + FUNC_END.len());
            self.phase = Phase::End;
            return true;
        }
        if !rest.starts_with(PARAM) {
            self.malformed(out);
            return true;
        }
        let Some(gt) = rest.find('>') else { return false };
        let Some(close) = rest.find(PARAM_END) else { return false };
        if close < gt {
            self.malformed(out);
            return true;
        }
        let pname = rest[PARAM.len()..gt].trim().to_string();
        let mut value = &rest[gt + 1..close];
        value = value.strip_prefix('\n').unwrap_or(value);
        value = value.strip_suffix('\n').unwrap_or(value);
        let name = self.calls.last().map(|c| c.name.clone()).unwrap_or_default();
        let v = self.value_json(&name, &pname, value);
        // Compact JSON, as OpenAI writes arguments.
        let sep = if self.params == 0 { "" } else { "," };
        let fragment = format!("{sep}{}:{}", Value::String(pname), v);
        self.params += 1;
        self.args.push_str(&fragment);
        let index = self.calls.len() - 1;
        // The first fragment carries the opening brace.
        let fragment = if self.params == 1 { format!("{{{fragment}") } else { fragment };
        out.push(ToolEvent::Args { index, fragment });
        self.consume(ws + close + PARAM_END.len());
        true
    }

    /// `</tool_call>`: the call is complete.
    fn end(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        let rest = skip_ws(&self.buf);
        let ws = self.buf.len() - rest.len();
        if rest.is_empty() || could_be(rest, CLOSE) {
            return false;
        }
        if !rest.starts_with(CLOSE) {
            self.malformed(out);
            return true;
        }
        self.consume(ws + CLOSE.len());
        let index = self.calls.len() - 1;
        let fragment = if self.params == 0 { "{}".to_string() } else { "}".to_string() };
        self.args.push('}');
        if let Some(c) = self.calls.last_mut() {
            c.arguments = if self.params == 0 { "{}".into() } else { std::mem::take(&mut self.args) };
        }
        out.push(ToolEvent::Args { index, fragment });
        out.push(ToolEvent::End { index });
        self.raw.clear();
        self.args.clear();
        self.started = false;
        self.phase = Phase::Text;
        true
    }

    /// The answer ended: a call still open is malformed (answered as text), held text is released.
    /// Returns the events and whether a call was cut off unfinished.
    pub fn finish(&mut self) -> (Vec<ToolEvent>, bool) {
        let mut out = Vec::new();
        let mut cut = false;
        // An open call is malformed; what followed its start is read again (each round takes at least
        // the `<tool_call>` it gave up on, so this ends).
        while !matches!(self.phase, Phase::Text) {
            cut = true;
            self.malformed(&mut out);
            out.extend(self.feed(""));
        }
        if !self.buf.is_empty() && (!self.single || self.calls.is_empty()) {
            out.push(ToolEvent::Text(std::mem::take(&mut self.buf)));
        }
        (out, cut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<ToolSpec> {
        parse_chat_tools(Some(&json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}}}}},
            {"type": "function", "function": {"name": "noop"}}
        ])))
        .expect("tools")
    }

    const ANSWER: &str = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>";

    fn collect(events: &[ToolEvent]) -> (String, Vec<(String, String)>) {
        let mut text = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in events {
            match e {
                ToolEvent::Text(t) => text.push_str(t),
                ToolEvent::Start { index, name, .. } => {
                    assert_eq!(*index, calls.len());
                    calls.push((name.clone(), String::new()));
                }
                ToolEvent::Args { index, fragment } => calls[*index].1.push_str(fragment),
                ToolEvent::End { index } => assert_eq!(*index + 1, calls.len()),
            }
        }
        (text, calls)
    }

    #[test]
    fn parses_calls_whole_and_in_every_split() {
        let want_args = r#"{"city":"New York","days":3,"opts":{"a":[1,2]}}"#;
        for step in [usize::MAX, 1, 2, 3, 7] {
            let mut p = ToolParser::new(&specs(), "call_".into(), true);
            let mut ev = Vec::new();
            let chars: Vec<char> = ANSWER.chars().collect();
            for chunk in chars.chunks(step.min(chars.len())) {
                ev.extend(p.feed(&chunk.iter().collect::<String>()));
            }
            let (rest, open) = p.finish();
            assert!(!open);
            ev.extend(rest);
            let (text, calls) = collect(&ev);
            assert_eq!(text.trim(), "Let me check.", "step {step}");
            assert_eq!(calls.len(), 2, "step {step}");
            assert_eq!(calls[0], ("get_weather".to_string(), want_args.to_string()), "step {step}");
            assert_eq!(calls[1], ("noop".to_string(), "{}".to_string()));
            assert_eq!(p.calls()[0].arguments, want_args);
            assert_eq!(p.calls()[1].arguments, "{}");
            let v: Value = serde_json::from_str(&p.calls()[0].arguments).expect("json");
            assert_eq!(v["days"], 3);
        }
    }

    #[test]
    fn malformed_or_cut_calls_come_back_as_text() {
        for bad in [
            "<tool_call>\nnot a call\n</tool_call> after",
            "<tool_call>\n<function=f>\n<oops>\n</function>\n</tool_call>",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        ] {
            let mut p = ToolParser::new(&specs(), "c".into(), true);
            let mut ev = p.feed(bad);
            let (rest, _) = p.finish();
            ev.extend(rest);
            let text: String =
                ev.iter().filter_map(|e| if let ToolEvent::Text(t) = e { Some(t.as_str()) } else { None }).collect();
            assert_eq!(text, bad);
            assert!(p.calls().is_empty(), "{bad}");
        }
        // Text that only looks like the start of a call is released at the end.
        let mut p = ToolParser::new(&specs(), "c".into(), true);
        assert!(p.feed("a <tool_c").iter().all(|e| e == &ToolEvent::Text("a ".into())));
        assert_eq!(p.finish().0, vec![ToolEvent::Text("<tool_c".into())]);
    }

    /// Issue 40: an integer argument written `-0` is the integer 0, not `-0.0`.
    #[test]
    fn an_integer_argument_of_minus_zero_is_zero() {
        let mut p = ToolParser::new(&specs(), "c".into(), true);
        let mut ev = p
            .feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n-0\n</parameter>\n</function>\n</tool_call>");
        ev.extend(p.finish().0);
        assert_eq!(p.calls()[0].arguments, r#"{"days":0}"#);
    }

    #[test]
    fn one_call_when_parallel_calls_are_off() {
        let mut p = ToolParser::new(&specs(), "c".into(), false);
        let mut ev = p.feed(ANSWER);
        ev.extend(p.finish().0);
        assert_eq!(collect(&ev).1.len(), 1);
        assert_eq!(p.calls().len(), 1);
    }

    #[test]
    fn requests_are_checked() {
        assert!(parse_chat_tools(Some(&json!([{"type": "retrieval"}]))).is_err());
        assert!(parse_chat_tools(Some(&json!([{"type": "function", "function": {"name": "a b"}}]))).is_err());
        let t = specs();
        assert_eq!(parse_tool_choice(Some(&json!("required")), &t).expect("ok"), ToolChoice::Required);
        assert!(parse_tool_choice(Some(&json!({"type": "function", "function": {"name": "nope"}})), &t).is_err());
        assert!(parse_tool_choice(Some(&json!("required")), &[]).is_err());
        let calls = template_calls(
            &json!([{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]),
            "m",
        )
        .expect("ok");
        assert_eq!(calls[0]["function"]["arguments"]["a"], 1);
        assert!(template_calls(&json!([{"function": {"name": "f", "arguments": "{oops"}}]), "m").is_err());
    }
}
