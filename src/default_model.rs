//! The embedded default model: `osprey serve` with no model argument serves the tiny `qwen3_5_moe`
//! checkpoint from `fixtures/` (random weights, a complete HF directory) until a trained default
//! exists. Its files are compiled into the binary and written once to a cache directory.

use std::path::PathBuf;

use anyhow::{Context, Result};

const FILES: [(&str, &[u8]); 7] = [
    ("config.json", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/config.json")),
    ("generation_config.json", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/generation_config.json")),
    ("model.safetensors", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/model.safetensors")),
    ("tokenizer.json", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/tokenizer_config.json")),
    ("processor_config.json", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/processor_config.json")),
    ("chat_template.jinja", include_bytes!("../fixtures/models/qwen3_5_moe-tiny/chat_template.jinja")),
];

/// Name the default model is served under.
pub const NAME: &str = "qwen3_5_moe-tiny";

/// Writes the embedded files (if missing or different) and returns the directory.
pub fn materialize() -> Result<PathBuf> {
    let base = std::env::var_os("OSPREY_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/osprey")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("default-model-{}", env!("CARGO_PKG_VERSION"))).join(NAME);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        let same = std::fs::read(&path).map(|b| b == bytes).unwrap_or(false);
        if !same {
            let tmp = dir.join(format!("{name}.tmp"));
            std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, &path)?;
        }
    }
    Ok(dir)
}
