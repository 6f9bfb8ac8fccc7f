//! What the Ollama API's listings say about a model directory: its family, parameter count, size on
//! disk, storage format, chat template, modification time and a digest. Read from the safetensors
//! headers (not the tensors) and the config.

use std::path::Path;

use blake2::{Blake2s256, Digest};
use osprey_server::ModelAbout;
use serde_json::Value;

/// The description of the model in `dir` (`family` is its config's `model_type`; `quantized` whether
/// the config declares a quantization).
pub fn model_about(dir: &Path, family: &str, quantized: bool) -> ModelAbout {
    let mut about = ModelAbout { family: family.to_string(), ..ModelAbout::default() };
    let mut dtypes = std::collections::BTreeMap::<String, u64>::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let mut hasher = Blake2s256::new();
    for f in &files {
        about.bytes += std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        let Some(header) = header(f) else { continue };
        hasher.update(header.to_string().as_bytes());
        for (name, t) in header.as_object().into_iter().flatten().filter(|(n, _)| *n != "__metadata__") {
            let dtype = t["dtype"].as_str().unwrap_or_default();
            let n: u64 = t["shape"].as_array().map_or(0, |s| s.iter().filter_map(Value::as_u64).product());
            // Scales of quantized weights are not parameters; a packed FP4 byte holds two.
            if name.contains("scale") && quantized {
                continue;
            }
            let n = if dtype == "U8" && quantized { 2 * n } else { n };
            about.parameters += n;
            *dtypes.entry(dtype.to_string()).or_default() += n;
        }
    }
    about.quantization = if quantized {
        "NVFP4".into()
    } else {
        dtypes.into_iter().max_by_key(|(_, n)| *n).map(|(d, _)| d).unwrap_or_default()
    };
    about.template = template(dir);
    let config = dir.join("config.json");
    about.modified = std::fs::metadata(&config)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs());
    hasher.update(std::fs::read(&config).unwrap_or_default());
    about.digest = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    about
}

/// A safetensors file's JSON header (its first 8 bytes give the header's length).
fn header(path: &Path) -> Option<Value> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    // A header is at most 100 MB by the format's own limit.
    if len > 100 << 20 {
        return None;
    }
    let mut buf = vec![0u8; len as usize];
    f.read_exact(&mut buf).ok()?;
    serde_json::from_slice(&buf).ok()
}

/// The chat template's text: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`.
fn template(dir: &Path) -> String {
    if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        return t;
    }
    std::fs::read_to_string(dir.join("tokenizer_config.json"))
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .and_then(|v| v.get("chat_template")?.as_str().map(String::from))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_model_is_described_from_its_files() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/osprey-default");
        let a = model_about(&dir, "qwen3_5", false);
        let size = std::fs::metadata(dir.join("model.safetensors")).expect("weights").len();
        assert_eq!(a.bytes, size);
        assert!(a.parameters > 100_000 && a.parameters * 2 <= size, "{} parameters in {size} bytes", a.parameters);
        assert_eq!(a.digest.len(), 64);
        assert!(a.template.contains("<|im_start|>"), "the chat template");
        assert!(!a.quantization.is_empty() && a.modified > 0, "{a:?}");
    }
}
