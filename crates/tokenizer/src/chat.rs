//! The checkpoint's own chat template, rendered with minijinja the way transformers renders it with
//! Jinja2: `trim_blocks`, `lstrip_blocks`, Python string methods (`.startswith`, `.split`, `.strip`, ...
//! via minijinja-contrib's pycompat), `raise_exception`, and a `tojson` equal to Python's
//! `json.dumps(x, ensure_ascii=False)` (separators `", "` / `": "`, no HTML escaping; minijinja's
//! built-in is compact and escapes HTML, which would change tool prompts).

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};

use crate::{Error, Result};

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    special: serde_json::Map<String, serde_json::Value>,
}

fn escape_py(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)`.
pub fn py_json_dumps(v: &serde_json::Value, indent: Option<usize>) -> String {
    fn go(v: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
        let (item_sep, nl) = match indent {
            Some(n) => (",".to_string(), format!("\n{}", " ".repeat(n * (level + 1)))),
            None => (", ".to_string(), String::new()),
        };
        let close = indent.map(|n| format!("\n{}", " ".repeat(n * level))).unwrap_or_default();
        match v {
            serde_json::Value::Null => out.push_str("null"),
            serde_json::Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            serde_json::Value::Number(n) => out.push_str(&n.to_string()),
            serde_json::Value::String(s) => escape_py(s, out),
            serde_json::Value::Array(a) if a.is_empty() => out.push_str("[]"),
            serde_json::Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&item_sep);
                    }
                    out.push_str(&nl);
                    go(x, indent, level + 1, out);
                }
                out.push_str(&close);
                out.push(']');
            }
            serde_json::Value::Object(m) if m.is_empty() => out.push_str("{}"),
            serde_json::Value::Object(m) => {
                out.push('{');
                for (i, (k, x)) in m.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&item_sep);
                    }
                    out.push_str(&nl);
                    escape_py(k, out);
                    out.push_str(": ");
                    go(x, indent, level + 1, out);
                }
                out.push_str(&close);
                out.push('}');
            }
        }
    }
    let mut out = String::new();
    go(v, indent, 0, &mut out);
    out
}

fn tojson(v: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accept and ignore the other json.dumps keywords templates pass.
    for k in ["ensure_ascii", "separators", "sort_keys"] {
        let _: Option<Value> = kwargs.get(k)?;
    }
    kwargs.assert_all_used()?;
    let j = serde_json::to_value(&v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(py_json_dumps(&j, indent)))
}

fn read(path: &Path) -> Result<Option<String>> {
    match osprey_models::files::read_small(path, osprey_models::files::MAX_TOKENIZER_BYTES) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::Load { path: path.to_path_buf(), reason: e.to_string() }),
    }
}

fn template_field(v: &serde_json::Value) -> Option<String> {
    match v.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        // A list of named templates: take "default".
        serde_json::Value::Array(a) => a
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}

impl ChatTemplate {
    /// Compiles a template source.
    pub fn new(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source).map_err(|e| Error::Template(format!("{e:#}")))?;
        Ok(ChatTemplate { env, special: serde_json::Map::new() })
    }

    /// Loads the template of a model directory: `chat_template.jinja`, else `chat_template` in
    /// `tokenizer_config.json`, else `chat_template.json`. Special tokens of `tokenizer_config.json`
    /// (`eos_token`, `pad_token`, `bos_token`) are put in the template context as transformers does.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<serde_json::Value> = read(&cfg_path)?
            .map(|s| serde_json::from_str(&s))
            .transpose()
            .map_err(|e| Error::Load { path: cfg_path.clone(), reason: e.to_string() })?;
        let source = match read(&dir.join("chat_template.jinja"))? {
            Some(s) => s,
            None => match cfg.as_ref().and_then(template_field) {
                Some(s) => s,
                None => {
                    let p = dir.join("chat_template.json");
                    let v: Option<serde_json::Value> = read(&p)?
                        .map(|s| serde_json::from_str(&s))
                        .transpose()
                        .map_err(|e| Error::Load { path: p.clone(), reason: e.to_string() })?;
                    v.as_ref().and_then(template_field).ok_or_else(|| Error::Load {
                        path: dir.to_path_buf(),
                        reason: "the model directory has no chat template".into(),
                    })?
                }
            },
        };
        let mut t = Self::new(source)?;
        if let Some(c) = cfg {
            for k in ["bos_token", "eos_token", "pad_token", "unk_token"] {
                if let Some(v) = c.get(k).filter(|v| v.is_string()) {
                    t.special.insert(k.to_string(), v.clone());
                }
            }
        }
        Ok(t)
    }

    /// The variables the template reads from its context besides `messages` and `add_generation_prompt`
    /// and the special tokens: the keys a request's `chat_template_kwargs` may set (`enable_thinking`,
    /// `tools`, ...), sorted. Globals the environment defines (`namespace`, `raise_exception`) are not
    /// variables.
    pub fn variables(&self) -> Vec<String> {
        let Ok(t) = self.env.get_template("chat") else { return Vec::new() };
        let mut v: Vec<String> = t
            .undeclared_variables(false)
            .into_iter()
            .filter(|k| !matches!(k.as_str(), "messages" | "add_generation_prompt"))
            .filter(|k| !self.special.contains_key(k) && self.env.globals().all(|(g, _)| g != k))
            .collect();
        v.sort();
        v
    }

    /// Renders `messages` (OpenAI-style JSON list) with `add_generation_prompt` and extra keyword
    /// arguments (`chat_template_kwargs`, e.g. `enable_thinking`, `tools`).
    pub fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx = self.special.clone();
        for (k, v) in kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(Value::from_serialize(&ctx)).map_err(|e| Error::Template(format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_dumps_format() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b": [1, 2.5, "é\n<a>"], "a": {}, "c": null}"#).expect("json");
        assert_eq!(py_json_dumps(&v, None), r#"{"b": [1, 2.5, "é\n<a>"], "a": {}, "c": null}"#);
        assert_eq!(py_json_dumps(&serde_json::json!({"x": [1]}), Some(2)), "{\n  \"x\": [\n    1\n  ]\n}");
    }

    #[test]
    fn python_methods_raise_exception_and_tojson_work() {
        let t = ChatTemplate::new(
            "{{ messages[0].content.split(',')[1].strip() }}|{{ 'ab'.startswith('a') }}|{{ messages|tojson }}".into(),
        )
        .expect("compile");
        let m = serde_json::json!([{"role": "user", "content": "x, y "}]);
        let out = t.render(&m, false, &serde_json::Map::new()).expect("render");
        assert_eq!(out, r#"y|True|[{"role": "user", "content": "x, y "}]"#);
        let bad = ChatTemplate::new("{{ raise_exception('no tools here') }}".into()).expect("compile");
        assert_eq!(t.variables(), Vec::<String>::new());
        let kw = ChatTemplate::new(
            "{% if tools is defined %}{{ tools }}{% endif %}{{ enable_thinking }}{{ namespace(a=1).a }}{{ messages }}"
                .into(),
        )
        .expect("compile");
        assert_eq!(kw.variables(), ["enable_thinking", "tools"]);
        assert!(bad
            .render(&m, false, &serde_json::Map::new())
            .expect_err("raises")
            .to_string()
            .contains("no tools here"));
    }
}
