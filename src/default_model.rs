//! The embedded default model: `osprey serve` with no model argument serves `osprey-default`, a tiny
//! `qwen3_5_moe` vision-language model trained by `tools/train_default.py` (names the shape and colour
//! in an image, describes two images in order, tells which way a shape moves in a short video, answers
//! a few text turns; see docs/default_model.md). Its files (a complete HF directory, 10 MB) are compiled
//! into the binary and written once to a cache directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result};

const FILES: [(&str, &[u8]); 7] = [
    ("config.json", include_bytes!("../fixtures/models/osprey-default/config.json")),
    ("generation_config.json", include_bytes!("../fixtures/models/osprey-default/generation_config.json")),
    ("model.safetensors", include_bytes!("../fixtures/models/osprey-default/model.safetensors")),
    ("tokenizer.json", include_bytes!("../fixtures/models/osprey-default/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../fixtures/models/osprey-default/tokenizer_config.json")),
    ("processor_config.json", include_bytes!("../fixtures/models/osprey-default/processor_config.json")),
    ("chat_template.jinja", include_bytes!("../fixtures/models/osprey-default/chat_template.jinja")),
];

/// Writes the tokenizer, its config, the chat template and the generation config into `dir`, beside a
/// synthetic checkpoint, so that it can be served (`bench synth` writes the media token ids of this
/// tokenizer).
pub fn write_tokenizer_files(dir: &Path) -> Result<()> {
    let own = |n: &str| matches!(n, "config.json" | "model.safetensors" | "processor_config.json");
    for (name, bytes) in FILES.into_iter().filter(|(n, _)| !own(n)) {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Name the default model is served under.
pub const NAME: &str = "osprey-default";

/// Writes the embedded files (if missing or different) and returns the directory.
pub fn materialize() -> Result<PathBuf> {
    let base = crate::cache_root().unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("default-model-{}", env!("CARGO_PKG_VERSION"))).join(NAME);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        let same = std::fs::read(&path).map(|b| b == bytes).unwrap_or(false);
        if !same {
            // A name of its own per writer: two servers (or test threads) may materialize at once, and
            // each rename is atomic, so readers see one complete file or the other (they are equal).
            static WRITES: AtomicUsize = AtomicUsize::new(0);
            let n = WRITES.fetch_add(1, Ordering::Relaxed);
            let tmp = dir.join(format!("{name}.{}.{n}.tmp", std::process::id()));
            std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
            std::fs::rename(&tmp, &path)?;
        }
    }
    Ok(dir)
}
