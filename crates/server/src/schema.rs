//! `response_format` into a grammar, and the bounds a JSON Schema must keep before it is compiled.

use osprey_protocol::constraint::Grammar;
use osprey_protocol::ErrorCode;
use serde_json::{json, Value};

use crate::error::{bad, ApiError};

/// `schema` in osprey's JSON layout: `", "` and `": "` separators (Python's `json.dumps`) and no free
/// whitespace, so a model, even a random one, cannot spend its tokens on blank space. `strict` keeps
/// llguidance's refusal of keywords it cannot enforce (else they are ignored, as OpenAI does for
/// non-strict schemas). `true` is the empty schema; `false` stays unsatisfiable.
pub fn json_layout(schema: &Value, strict: bool) -> Value {
    let mut s = match schema {
        Value::Object(m) => Value::Object(m.clone()),
        Value::Bool(false) => return Value::Bool(false),
        _ => json!({}),
    };
    s["x-guidance"] =
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": !strict});
    s
}

/// Largest schema, in bytes of JSON, on every path (real schemas are a few KB; llguidance's own
/// limits bound the compile further).
const MAX_SCHEMA_BYTES: usize = 256 << 10;

/// Deepest a schema may nest once its `$ref`s are followed: JSON nesting plus one level per `$ref` hop
/// on the deepest path. Real schemas stay under 20; a chain of 700 `$ref`s overflowed the grammar
/// compiler's stack before this bound.
pub const MAX_SCHEMA_DEPTH: usize = 64;

/// Largest integer bound the grammar enforces exactly (beyond 2^53, JSON numbers lose integer precision
/// and the grammar engine clamps to 64 bits: `minimum: 1e30` once answered 9223372036854775807).
const MAX_INTEGER_BOUND: f64 = 9_007_199_254_740_992.0;
/// Number bounds are enforced for magnitudes in [1e-9, 1e15] (and 0): a range such as `(0, 1e-300)`
/// needs more digits than the grammar writes and once answered 0.
const NUMBER_BOUNDS: (f64, f64) = (1e-9, 1e15);

/// A client's JSON Schema as the grammar the tokenizer compiles, after `check_schema` (the path of
/// `response_format`; the `schema` fuzz target's entry).
pub fn schema_grammar(schema: &Value, strict: bool) -> Result<Grammar, ApiError> {
    check_schema(schema, "schema")?;
    Ok(Grammar::JsonSchema(json_layout(schema, strict)))
}

/// The one schema gate: every path by which a client's schema reaches the grammar compiler calls it
/// first — `response_format`, Responses' `text.format`, chat and Responses `tools[].parameters`, Messages
/// `tools[].input_schema` and `output_config.format` — and a refusal names `param`, the parameter that
/// carried the schema. It checks what the schema may cost before any grammar work: at most
/// [`MAX_SCHEMA_BYTES`] of JSON; `$ref` targets (local JSON pointers) followed with cycle detection, the
/// deepest path, counting each hop, within [`MAX_SCHEMA_DEPTH`]; every bound it sets one the grammar
/// enforces. A recursive `$ref` is allowed (it describes a tree); whether its values can end is the
/// compiler's decision, refused as 400 too.
pub(crate) fn check_schema(schema: &Value, param: &str) -> Result<(), ApiError> {
    let n = schema.to_string().len();
    if n > MAX_SCHEMA_BYTES {
        return Err(bad(
            ErrorCode::InvalidSchema,
            format!("the schema is {n} bytes of JSON, more than the limit of {MAX_SCHEMA_BYTES}"),
            param,
        ));
    }
    let mut walk = Walk { root: schema, on_path: Vec::new(), memo: std::collections::HashMap::new(), param };
    let depth = walk.depth(schema, 0)?;
    if depth > MAX_SCHEMA_DEPTH {
        return Err(too_deep(param));
    }
    let mut seen = Required { root: schema, state: std::collections::HashMap::new() };
    if seen.cycles(schema) {
        return Err(bad(
            ErrorCode::InvalidSchema,
            "the schema requires itself through its $refs (a required property, item or allOf leads back to it), so no finite value satisfies it",
            param,
        ));
    }
    Ok(())
}

/// Finds a cycle of schemas each of which every valid value must contain: a `$ref` target, an `allOf`
/// member, a required property's schema, the items of an array with `minItems` ≥ 1. Such a schema has
/// no finite instance; the grammar engine compiles it and then fails on the first value ("too many
/// items"), so it is refused here.
struct Required<'a> {
    root: &'a Value,
    /// `false` while on the current path, `true` once finished.
    state: std::collections::HashMap<*const Value, bool>,
}

impl<'a> Required<'a> {
    fn cycles(&mut self, v: &'a Value) -> bool {
        let key = v as *const Value;
        match self.state.get(&key) {
            Some(false) => return true,
            Some(true) => return false,
            None => {}
        }
        self.state.insert(key, false);
        let found = self.must_contain(v).into_iter().any(|c| self.cycles(c));
        self.state.insert(key, true);
        found
    }

    fn must_contain(&self, v: &'a Value) -> Vec<&'a Value> {
        let Value::Object(m) = v else { return Vec::new() };
        let mut out = Vec::new();
        if let Some(t) = m.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')) {
            out.extend(self.root.pointer(&percent_decode(t)));
        }
        if let Some(Value::Array(all)) = m.get("allOf") {
            out.extend(all.iter());
        }
        if let (Some(Value::Object(props)), Some(Value::Array(req))) = (m.get("properties"), m.get("required")) {
            out.extend(req.iter().filter_map(Value::as_str).filter_map(|k| props.get(k)));
        }
        if m.get("minItems").and_then(Value::as_u64).is_some_and(|n| n >= 1) {
            out.extend(m.get("items").filter(|i| i.is_object()));
        }
        out
    }
}

fn too_deep(param: &str) -> ApiError {
    bad(
        ErrorCode::InvalidSchema,
        format!("the schema nests deeper than {MAX_SCHEMA_DEPTH} levels once its $refs are followed"),
        param,
    )
}

struct Walk<'a> {
    root: &'a Value,
    /// `$ref` targets being expanded on the current path (a repeat is recursion, not followed again).
    on_path: Vec<*const Value>,
    /// Depth below each `$ref` target already measured.
    memo: std::collections::HashMap<*const Value, usize>,
    param: &'a str,
}

impl<'a> Walk<'a> {
    /// Depth below `v` (`level` is how deep `v` already is, to stop early without recursing far).
    fn depth(&mut self, v: &'a Value, level: usize) -> Result<usize, ApiError> {
        if level > MAX_SCHEMA_DEPTH {
            return Err(too_deep(self.param));
        }
        let below = match v {
            Value::Object(m) => {
                check_bounds(m, self.param)?;
                let mut d = 0;
                if let Some(target) = m.get("$ref").and_then(Value::as_str).and_then(|r| self.resolve(r)) {
                    d = d.max(self.follow(target, level)?);
                }
                for child in m.values() {
                    d = d.max(self.depth(child, level + 1)?);
                }
                d
            }
            Value::Array(a) => {
                let mut d = 0;
                for child in a {
                    d = d.max(self.depth(child, level + 1)?);
                }
                d
            }
            _ => return Ok(0),
        };
        Ok(below + 1)
    }

    fn follow(&mut self, target: &'a Value, level: usize) -> Result<usize, ApiError> {
        let key = target as *const Value;
        if self.on_path.contains(&key) {
            return Ok(0);
        }
        if let Some(&d) = self.memo.get(&key) {
            if level + d > MAX_SCHEMA_DEPTH {
                return Err(too_deep(self.param));
            }
            return Ok(d);
        }
        self.on_path.push(key);
        let d = self.depth(target, level + 1)?;
        self.on_path.pop();
        self.memo.insert(key, d);
        Ok(d)
    }

    /// A local `$ref` (`#`, `#/$defs/x`, `#/definitions/x`, any JSON pointer); others are the compiler's.
    fn resolve(&self, r: &str) -> Option<&'a Value> {
        let pointer = r.strip_prefix('#')?;
        let decoded = percent_decode(pointer);
        self.root.pointer(&decoded)
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Refuses numeric bounds the grammar cannot enforce (see [`MAX_INTEGER_BOUND`], [`NUMBER_BOUNDS`]).
fn check_bounds(m: &serde_json::Map<String, Value>, param: &str) -> Result<(), ApiError> {
    let ty = m.get("type");
    let has = |t: &str| match ty {
        Some(Value::String(s)) => s == t,
        Some(Value::Array(a)) => a.iter().any(|x| x == t),
        _ => false,
    };
    let (integer, number) = (has("integer"), has("number"));
    if !integer && !number {
        return Ok(());
    }
    for key in ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"] {
        let Some(b) = m.get(key) else { continue };
        let Some(x) = b.as_f64().filter(|x| x.is_finite()) else {
            if b.is_boolean() && key.starts_with("exclusive") {
                continue; // draft-4 style flags
            }
            return Err(bad(ErrorCode::InvalidSchema, format!("`{key}` must be a number"), param));
        };
        let ok = if number {
            x == 0.0 || (NUMBER_BOUNDS.0..=NUMBER_BOUNDS.1).contains(&x.abs())
        } else {
            x.abs() <= MAX_INTEGER_BOUND
        };
        if !ok {
            let range = if number {
                format!("0 or a magnitude between {:e} and {:e}", NUMBER_BOUNDS.0, NUMBER_BOUNDS.1)
            } else {
                format!("within ±2^53 ({MAX_INTEGER_BOUND})")
            };
            return Err(bad(
                ErrorCode::InvalidSchema,
                format!("`{key}: {b}` cannot be enforced on the output; bounds must be {range}"),
                param,
            ));
        }
    }
    Ok(())
}

/// `response_format` as a grammar (`None` for plain text).
pub(super) fn response_format(rf: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(rf) = rf.filter(|v| !v.is_null()) else { return Ok(None) };
    let p = "response_format";
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonSchema(json_layout(&json!({"type": "object"}), false)))),
        Some("json_schema") => {
            // Chat nests the fields in `json_schema`; the Responses API's `text.format` has them at the top.
            let js = rf.get("json_schema").filter(|v| v.is_object()).unwrap_or(rf);
            let schema = js.get("schema").cloned().ok_or_else(|| {
                bad(ErrorCode::InvalidRequest, "json_schema needs `json_schema`: {\"name\", \"schema\"}", p)
            })?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(bad(
                    ErrorCode::InvalidSchema,
                    "the schema must be a JSON Schema object",
                    &format!("{p}.json_schema.schema"),
                ));
            }
            // Compiling is paid before admission, on a tokenizer worker: bound what one request can ask.
            check_schema(&schema, &format!("{p}.json_schema.schema"))?;
            let strict = js.get("strict").and_then(Value::as_bool).unwrap_or(false);
            Ok(Some(Grammar::JsonSchema(json_layout(&schema, strict))))
        }
        other => Err(bad(
            ErrorCode::InvalidRequest,
            format!("response_format type {} is not text, json_object or json_schema", crate::error::shown(other)),
            p,
        )),
    }
}
