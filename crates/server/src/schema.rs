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
    let mut conj = Conjunction { root: schema, on_path: Vec::new(), memo: std::collections::HashMap::new() };
    let n = conj.regexes(schema);
    if n > MAX_INTERSECTED_REGEXES {
        return Err(bad(
            ErrorCode::InvalidSchema,
            format!(
                "up to {n} string patterns and formats apply to one value at once (through allOf, $ref or their \
                 alternatives); at most {MAX_INTERSECTED_REGEXES} may, since the grammar intersects them"
            ),
            param,
        ));
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

/// The values of an enum of strings (a parameter the call syntax writes as raw text, one of them).
pub(crate) fn string_enum(schema: &Value) -> Option<&Vec<Value>> {
    schema.get("enum").and_then(Value::as_array).filter(|e| !e.is_empty() && e.iter().all(Value::is_string))
}

/// Whether the call syntax writes a value of `schema` as raw text (a string, or one of an enum of
/// strings) rather than JSON; the call grammar and the call parser agree on it.
pub(crate) fn raw_text(schema: &Value) -> bool {
    string_enum(schema).is_some() || schema.get("type").and_then(Value::as_str) == Some("string")
}

/// The schema `schema`'s own `$ref` names in `root`, when it is a local pointer (`#`, `#/$defs/x`,
/// `#/definitions/x`, any JSON pointer, percent-encoded or not) that resolves; others are the
/// compiler's (and refused by `check_references`).
fn ref_target<'a>(root: &'a Value, schema: &Value) -> Option<&'a Value> {
    let pointer = schema.get("$ref")?.as_str()?.strip_prefix('#')?;
    root.pointer(&percent_decode(pointer))
}

/// `schema` (a part of `root`) with its own `$ref`s followed to what they name in `root`, at most
/// [`MAX_SCHEMA_DEPTH`] hops: pydantic writes a nested model or an Enum field as `{"$ref": "#/$defs/X"}`
/// (siblings such as `description` or `default` do not constrain the value and are passed over).
pub(crate) fn follow_refs<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    let mut s = schema;
    for _ in 0..MAX_SCHEMA_DEPTH {
        match ref_target(root, s) {
            Some(t) => s = t,
            None => break,
        }
    }
    s
}

/// `schema`, a part of `root`, as a schema document of its own whose `$ref`s name what they named in
/// `root`: `root`'s `$defs` and `definitions` come along whole, and every other local pointer (`#`,
/// `#/properties/x`, as zod-to-json-schema writes for a repeated schema) is copied into `$defs` under a
/// new name, the copy's own pointers rewritten the same way. A forced call's parameter compiles this way
/// (each is a grammar rule of its own): compiled alone, `#/$defs/S` named nothing.
pub(crate) fn rooted(root: &Value, schema: &Value) -> Value {
    let Value::Object(_) = schema else { return json!({}) };
    let mut doc = schema.clone();
    let mut copies = Copies { root, names: std::collections::HashMap::new(), pending: Vec::new() };
    copies.rewrite(&mut doc);
    let mut kept: Vec<(&str, serde_json::Map<String, Value>)> = Vec::new();
    for key in ["$defs", "definitions"] {
        let mut m = root.get(key).and_then(Value::as_object).cloned().unwrap_or_default();
        for v in m.values_mut() {
            copies.rewrite(v);
        }
        kept.push((key, m));
    }
    while let Some((name, mut v)) = copies.pending.pop() {
        copies.rewrite(&mut v);
        kept[0].1.insert(name, v);
    }
    for (key, m) in kept {
        match (m.is_empty(), doc.as_object_mut()) {
            (false, Some(d)) => {
                d.insert(key.to_string(), Value::Object(m));
            }
            (true, Some(d)) => {
                d.remove(key);
            }
            _ => {}
        }
    }
    doc
}

/// The pointers [`rooted`] copies: each target once, named `osprey-ref-N`.
struct Copies<'a> {
    root: &'a Value,
    names: std::collections::HashMap<String, String>,
    pending: Vec<(String, Value)>,
}

impl Copies<'_> {
    fn rewrite(&mut self, v: &mut Value) {
        match v {
            Value::Object(m) => {
                let target =
                    m.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')).map(percent_decode);
                if let Some(p) = target.filter(|p| !p.starts_with("/$defs/") && !p.starts_with("/definitions/")) {
                    if let Some(t) = self.root.pointer(&p) {
                        let n = self.names.len();
                        let name = self.names.entry(p).or_insert_with(|| {
                            let name = format!("osprey-ref-{n}");
                            self.pending.push((name.clone(), t.clone()));
                            name
                        });
                        m.insert("$ref".into(), Value::String(format!("#/$defs/{name}")));
                    }
                }
                for (k, child) in m.iter_mut() {
                    // A nested `$defs` is only reachable by pointers from the root, which are copied.
                    if k != "$ref" {
                        self.rewrite(child);
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|c| self.rewrite(c)),
            _ => {}
        }
    }
}

/// Most regular expressions (`pattern`, `format`) that may apply to one value at once. The grammar
/// compiler intersects them and decides whether the intersection is empty; that search doubles with
/// each one (`allOf` of `^(.*a.{i})` for i < n: 11 patterns 2.6 ms, 18 patterns 133 ms, 24 never
/// answered and took gigabytes), and no fuel stops it inside one step. Eight of any shape we tried (up
/// to 16 alternatives each) compile in under a millisecond; real schemas have one or two.
pub const MAX_INTERSECTED_REGEXES: usize = 8;

/// Counts, for the values a schema describes, the most regular expressions one value must match at
/// once: its own `pattern` and `format`, plus every `allOf` member's and its `$ref` target's (a `$ref`
/// with siblings intersects them), plus the worst of its `anyOf` / `oneOf` branches (an intersection
/// distributes over them). Properties and items are other values and do not add.
struct Conjunction<'a> {
    root: &'a Value,
    on_path: Vec<*const Value>,
    memo: std::collections::HashMap<*const Value, usize>,
}

impl<'a> Conjunction<'a> {
    /// The largest count over every subschema of `v` (each a value of its own).
    fn regexes(&mut self, v: &'a Value) -> usize {
        let here = self.at(v);
        let below = match v {
            Value::Object(m) => m.values().map(|c| self.regexes_of_children(c)).max().unwrap_or(0),
            _ => 0,
        };
        here.max(below)
    }

    fn regexes_of_children(&mut self, v: &'a Value) -> usize {
        match v {
            Value::Object(_) => self.regexes(v),
            Value::Array(a) => a.iter().map(|c| self.regexes(c)).max().unwrap_or(0),
            _ => 0,
        }
    }

    /// Regular expressions a value described by `v` must match at once.
    fn at(&mut self, v: &'a Value) -> usize {
        let Value::Object(m) = v else { return 0 };
        let key = v as *const Value;
        if let Some(&n) = self.memo.get(&key) {
            return n;
        }
        if self.on_path.contains(&key) {
            return 0; // recursion describes nested values, counted where they are
        }
        self.on_path.push(key);
        let mut n = usize::from(m.get("pattern").is_some_and(Value::is_string))
            + usize::from(m.get("format").is_some_and(Value::is_string));
        if let Some(Value::Array(all)) = m.get("allOf") {
            n += all.iter().map(|c| self.at(c)).sum::<usize>();
        }
        if let Some(t) = ref_target(self.root, v) {
            n += self.at(t);
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(alts)) = m.get(key) {
                n += alts.iter().map(|c| self.at(c)).max().unwrap_or(0);
            }
        }
        self.on_path.pop();
        self.memo.insert(key, n);
        n
    }
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
        out.extend(ref_target(self.root, v));
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
                check_references(m, std::ptr::eq(v, self.root), self.param)?;
                let mut d = 0;
                if let Some(target) = ref_target(self.root, v) {
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

/// Keywords that name schemas other than by a local JSON pointer: the compiler resolves them, but the
/// depth walk cannot count their hops (a 2,000-hop `$anchor` chain compiled).
const UNCOUNTED_REFERENCES: [&str; 5] =
    ["$anchor", "$dynamicAnchor", "$dynamicRef", "$recursiveRef", "$recursiveAnchor"];

/// Refuses references the depth bound cannot follow: a `$ref` that is not a local pointer (`#…`), an
/// anchor, and an `$id` below the root (which would give the pointers beneath it another base). Real
/// schemas (pydantic, zod, OpenAI's strict mode) use `#/$defs/…` and `#` only.
fn check_references(m: &serde_json::Map<String, Value>, root: bool, param: &str) -> Result<(), ApiError> {
    let refuse = |what: String| {
        Err(bad(
            ErrorCode::InvalidSchema,
            format!("{what}: schemas may refer to their parts only by local JSON pointers (`#/$defs/Name`, `#`)"),
            param,
        ))
    };
    if let Some(r) = m.get("$ref").and_then(Value::as_str).filter(|r| !r.starts_with('#')) {
        return refuse(format!("`$ref` {} is not a local pointer", crate::error::shown(Some(r))));
    }
    if let Some(k) = UNCOUNTED_REFERENCES.iter().find(|k| m.get(**k).is_some_and(Value::is_string)) {
        return refuse(format!("`{k}` is not supported"));
    }
    if !root && m.get("$id").is_some_and(Value::is_string) {
        return refuse("`$id` below the root is not supported".to_string());
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(n: usize) -> Value {
        let all: Vec<Value> =
            (1..=n).map(|i| json!({"type": "string", "pattern": format!("^(.*a.{{{i}}})")})).collect();
        json!({"allOf": all})
    }

    /// Issue 49: the 1.2 KB schema that compiled forever (23 patterns on one string) is refused at the
    /// gate; eight pass; the count goes through `$ref`s and takes the worst `anyOf` branch, and patterns
    /// of different properties do not add up. Mutation-checked: counting `anyOf` branches as 0 lets the
    /// third case through.
    #[test]
    fn more_than_eight_regexes_on_one_value_are_refused() {
        assert!(check_schema(&patterns(23), "p").is_err());
        assert!(check_schema(&patterns(MAX_INTERSECTED_REGEXES), "p").is_ok());
        assert!(check_schema(&patterns(MAX_INTERSECTED_REGEXES + 1), "p").is_err());
        let via_refs = json!({"$defs": {"P": patterns(5)}, "allOf": [{"$ref": "#/$defs/P"}, {"anyOf": [patterns(1), patterns(4)]}]});
        let e = check_schema(&via_refs, "p").expect_err("5 + 4 through a $ref and an anyOf");
        assert!(e.0.message.contains("at most 8"), "{e}");
        let apart: serde_json::Map<String, Value> = (0..30).map(|i| (format!("p{i}"), patterns(4))).collect();
        assert!(check_schema(&json!({"type": "object", "properties": apart}), "p").is_ok());
        let recursive =
            json!({"$defs": {"T": {"pattern": "a", "properties": {"t": {"$ref": "#/$defs/T"}}}}, "$ref": "#/$defs/T"});
        assert!(check_schema(&recursive, "p").is_ok());
    }

    /// Issue 49: references the depth bound cannot count (anchors, `$id` below the root, absolute
    /// URIs) are refused; local pointers pass.
    #[test]
    fn only_local_pointer_references_pass() {
        for bad in [
            json!({"$defs": {"a": {"$anchor": "x", "type": "string"}}, "$ref": "#x"}),
            json!({"properties": {"a": {"$id": "https://x/y", "type": "string"}}}),
            json!({"$id": "https://x/s", "$defs": {"a": {"type": "string"}}, "$ref": "https://x/s#/$defs/a"}),
            json!({"$dynamicRef": "#meta"}),
        ] {
            assert!(check_schema(&bad, "p").is_err(), "{bad}");
        }
        let ok = json!({"$id": "https://x/s", "$defs": {"a": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/a"}, "b": {"$ref": "#"}}});
        assert!(check_schema(&ok, "p").is_ok());
    }

    /// A part of a tool's schema compiled alone keeps its pointers' meaning: `$defs` come along, other
    /// pointers are copied under new names (their own pointers rewritten too).
    #[test]
    fn a_rooted_part_names_what_its_pointers_named() {
        let root = json!({
            "$defs": {"S": {"type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}}, "C": {"enum": ["r", "g"]}},
            "properties": {"s": {"$ref": "#/$defs/S"}, "t": {"type": "array", "items": {"$ref": "#/properties/u"}},
                           "u": {"type": "integer", "maximum": 3}}
        });
        let s = rooted(&root, &root["properties"]["s"]);
        assert_eq!(s["$ref"], "#/$defs/S");
        assert_eq!(s["$defs"]["C"], json!({"enum": ["r", "g"]}));
        let t = rooted(&root, &root["properties"]["t"]);
        assert_eq!(t["items"]["$ref"], "#/$defs/osprey-ref-0");
        assert_eq!(t["$defs"]["osprey-ref-0"], json!({"type": "integer", "maximum": 3}));
        assert_eq!(follow_refs(&root, &root["properties"]["s"])["type"], "object");
        assert_eq!(rooted(&root, &json!(true)), json!({}));
    }
}
