//! `chat_template_kwargs`: only the variables the chat template reads, each of the type it expects. A
//! key the template does not read is refused rather than carried (it changed nothing and could be any
//! size); `tools` given here is taken out and checked as the request's `tools` are (names, schemas,
//! prompt size), so the two ways of offering tools are one.

use osprey_protocol::ErrorCode;
use serde_json::{Map, Value};

use crate::config::ServerConfig;
use crate::error::bad;
use crate::error::ApiError;

/// The request's template arguments without `tools`, and the `tools` it carried.
pub(super) fn split(
    kwargs: Option<&Map<String, Value>>,
    cfg: &ServerConfig,
) -> Result<(Map<String, Value>, Option<Value>), ApiError> {
    let mut rest = Map::new();
    let mut tools = None;
    for (k, v) in kwargs.into_iter().flatten() {
        let param = format!("chat_template_kwargs.{}", k.chars().take(64).collect::<String>());
        if let Some(vars) = &cfg.template_kwargs {
            if !vars.iter().any(|x| x == k) {
                return Err(bad(
                    ErrorCode::UnsupportedParameter,
                    format!("the chat template does not read this argument; it reads: {}", vars.join(", ")),
                    &param,
                ));
            }
        }
        match k.as_str() {
            "tools" => tools = Some(v.clone()),
            "enable_thinking" if !(v.is_boolean() || v.is_null()) => {
                return Err(bad(ErrorCode::InvalidRequest, "enable_thinking must be true or false", &param))
            }
            _ => {
                rest.insert(k.clone(), v.clone());
            }
        }
    }
    Ok((rest, tools))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn cfg(vars: &[&str]) -> ServerConfig {
        ServerConfig { template_kwargs: Some(vars.iter().map(|s| s.to_string()).collect()), ..ServerConfig::test() }
    }

    fn code(r: Result<(Map<String, Value>, Option<Value>), ApiError>) -> String {
        r.err()
            .map(|e| format!("{} {}", e.0.code.as_str(), e.0.param.unwrap_or_default()))
            .unwrap_or_else(|| "ok".into())
    }

    #[test]
    fn only_the_templates_own_variables_are_taken() {
        let c = cfg(&["enable_thinking", "tools"]);
        let kw = |v: Value| v.as_object().cloned();
        assert_eq!(code(split(kw(json!({"enable_thinking": false})).as_ref(), &c)), "ok");
        assert_eq!(
            code(split(kw(json!({"junk": [[], []]})).as_ref(), &c)),
            "unsupported_parameter chat_template_kwargs.junk"
        );
        assert_eq!(
            code(split(kw(json!({"enable_thinking": "yes"})).as_ref(), &c)),
            "invalid_request chat_template_kwargs.enable_thinking"
        );
        let (rest, tools) = split(kw(json!({"tools": [1], "enable_thinking": true})).as_ref(), &c).expect("ok");
        assert_eq!(tools, Some(json!([1])));
        assert_eq!(Value::Object(rest), json!({"enable_thinking": true}));
    }
}
