//! The grammars an answer must follow, built here and compiled by the tokenizer actor (llguidance,
//! which owns the vocabulary): JSON Schemas in osprey's one JSON layout, for `response_format` and for
//! the values of forced tool calls, and the Lark grammar of the call syntax the chat template teaches.

use serde_json::{Map, Value};

use crate::schema::{follow_refs, json_layout, rooted, string_enum};
use crate::tools::ToolSpec;

/// A Lark grammar that forces calls in the template's syntax: one call (`parallel` false) or one or
/// more, to `only` or to any of `tools`. Required parameters come in schema order, optional ones may be
/// left out; a string parameter is raw text without `<` (its value ends at `</parameter>`), an enum of
/// strings is one of its values, anything else is JSON valid under the parameter's schema.
pub fn call_grammar(tools: &[ToolSpec], only: Option<&str>, parallel: bool) -> String {
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    let mut rules = Vec::new();
    let mut alts = Vec::new();
    for (i, t) in tools.iter().enumerate().filter(|(_, t)| only.is_none_or(|n| n == t.name)) {
        let required: Vec<&str> = t
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = vec![lit(&format!("<tool_call>\n<function={}>\n", t.name))];
        let empty = Map::new();
        let props = t.parameters.get("properties").and_then(Value::as_object).unwrap_or(&empty);
        for (j, (pname, declared)) in props.iter().enumerate() {
            let open = lit(&format!("<parameter={pname}>\n"));
            // Classified by what its `$ref`s name (a pydantic Enum is a string enum behind a `$ref`).
            let pschema = follow_refs(&t.parameters, declared);
            let value = if let Some(e) = string_enum(pschema) {
                let alts: Vec<String> = e.iter().filter_map(Value::as_str).map(lit).collect();
                format!("({}) \"\\n</parameter>\\n\"", alts.join(" | "))
            } else if pschema.get("type").and_then(Value::as_str) == Some("string") {
                // Raw text up to `</parameter>`, within the schema's length bounds when it gives them.
                let lo = pschema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
                match pschema.get("maxLength").and_then(Value::as_u64) {
                    None if lo == 0 => "STRING_VALUE".to_string(),
                    hi => {
                        let hi = hi.map(|h| h.max(lo).to_string()).unwrap_or_default();
                        rules.push(format!("C{i}_S{j}: /[^<]{{{lo},{hi}}}\\n<\\/parameter>\\n/"));
                        format!("C{i}_S{j}")
                    }
                }
            } else {
                // JSON valid under the parameter's schema, its `$ref`s meaning what they mean in the tool's
                // (a non-object schema accepts any value, as before).
                rules.push(format!("c{i}_v{j}: %json {}", json_layout(&rooted(&t.parameters, declared), false)));
                format!("c{i}_v{j} \"\\n</parameter>\\n\"")
            };
            rules.push(format!("c{i}_p{j}: {open} {value}"));
            let opt = if required.contains(&pname.as_str()) { "" } else { "?" };
            body.push(format!("c{i}_p{j}{opt}"));
        }
        body.push(lit("</function>\n</tool_call>"));
        rules.push(format!("c{i}: {}", body.join(" ")));
        alts.push(format!("c{i}"));
    }
    let start = if parallel { "start: call (\"\\n\" call)*" } else { "start: call" };
    let mut g = vec![start.to_string(), format!("call: {}", alts.join(" | "))];
    g.extend(rules);
    g.push(r"STRING_VALUE: /[^<]*\n<\/parameter>\n/".to_string());
    g.join("\n") + "\n"
}
