//! Downloading a model by Hugging Face id into the standard cache, with the `hf-hub` client (its
//! blocking API): only the files a model needs, resumable (a cut download continues from its `.part`
//! file on the next try), a progress bar on a terminal and plain lines in a log, `HF_TOKEN` (or the
//! token file `huggingface-cli login` writes) for gated repositories. `osprey pull ID` runs it alone;
//! `--model ID` runs it when the id is not in the cache and `HF_HUB_OFFLINE` is not set. docs/models.md.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::api::Progress;
use hf_hub::{Cache, Repo, RepoType};

/// Whether a file of a model repository is one a model directory needs: config, weights (safetensors,
/// their index), tokenizer, chat template, processor configs. Not README, other formats (`.bin`, `.pth`,
/// ONNX, GGUF) or anything in a subfolder.
pub fn needed(file: &str) -> bool {
    const NAMES: &[&str] = &[
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
        "hf_quant_config.json",
        "vocab.json",
        "merges.txt",
    ];
    !file.contains('/') && (NAMES.contains(&file) || file.ends_with(".safetensors"))
}

/// Where a pull goes and how it reaches the hub.
#[derive(Clone, Debug)]
pub struct Hub {
    /// The hub cache (`models--org--name/…` inside).
    pub cache: PathBuf,
    /// The hub's address (`HF_ENDPOINT`, else `https://huggingface.co`).
    pub endpoint: String,
    /// A token for gated or private repositories.
    pub token: Option<String>,
}

impl Hub {
    /// From the environment: the cache [`cache_dir`] resolves, `HF_ENDPOINT`, `HF_TOKEN` (else
    /// the token file next to the cache).
    pub fn from_env() -> Result<Self> {
        let cache = cache_dir().context("no Hugging Face cache directory: set HF_HUB_CACHE or HF_HOME")?;
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let token = var("HF_TOKEN").or_else(|| Cache::new(cache.clone()).token());
        Ok(Hub { cache, endpoint: var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()), token })
    }
}

/// The hub cache this process uses (the hub client's order of variables).
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("HF_HUB_CACHE")
        .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")))
}

/// Downloads `org/name` at `revision` into the hub cache and returns its snapshot directory. Files
/// already there are not fetched again; `config.json` comes last, so a snapshot with a config is whole
/// (what [`crate::hub::resolve_in`] checks).
pub fn pull(hub: &Hub, id: &str, revision: &str) -> Result<PathBuf> {
    let terminal = std::io::stderr().is_terminal();
    let api = ApiBuilder::from_cache(Cache::new(hub.cache.clone()))
        .with_endpoint(hub.endpoint.clone())
        .with_token(hub.token.clone())
        .with_progress(terminal)
        .build()
        .context("starting the Hugging Face client")?;
    let repo = api.repo(Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string()));
    let info = repo.info().map_err(|e| explain(e, id, hub.token.is_some()))?;
    let mut files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).filter(|f| needed(f)).collect();
    if !files.iter().any(|f| f == "config.json") {
        bail!("{id}@{revision} has no config.json: not a transformers model repository");
    }
    if !files.iter().any(|f| f.ends_with(".safetensors")) {
        bail!("{id}@{revision} has no safetensors weights (osprey reads safetensors only)");
    }
    // The config last: its presence marks a whole snapshot.
    files.sort_by_key(|f| (f == "config.json", f.clone()));
    let mut snapshot = None;
    let cached = Cache::new(hub.cache.clone()).repo(Repo::with_revision(id.into(), RepoType::Model, revision.into()));
    for f in &files {
        if let Some(path) = cached.get(f) {
            snapshot = path.parent().map(Path::to_path_buf);
            continue;
        }
        let path = if terminal {
            repo.download(f) // hf-hub's own progress bar
        } else {
            repo.download_with_progress(f, Lines::default())
        }
        .map_err(|e| explain(e, id, hub.token.is_some()))
        .with_context(|| format!("downloading {f} of {id}@{revision}"))?;
        snapshot = path.parent().map(Path::to_path_buf);
    }
    // hf-hub wrote refs/<revision> with the commit, as the Python client does.
    let snapshot = snapshot.ok_or_else(|| anyhow!("{id}@{revision}: nothing to download"))?;
    tracing::info!(model = %format!("{id}@{revision}"), files = files.len(), dir = %snapshot.display(), "pulled");
    Ok(snapshot)
}

/// A hub error as what the user can do about it.
fn explain(e: ApiError, id: &str, has_token: bool) -> anyhow::Error {
    let status = match &e {
        ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        _ => None,
    };
    match status {
        Some(401 | 403) if has_token => {
            anyhow!("{id}: the hub refused the token ({e}); the repository may be gated: accept its terms on its page")
        }
        Some(401 | 403) => anyhow!(
            "{id} is gated or private ({e}): set HF_TOKEN (or run `huggingface-cli login`) with a token that has access"
        ),
        Some(404) => anyhow!("{id}: no such model repository or revision on the hub ({e})"),
        _ => anyhow!("{id}: {e}"),
    }
}

/// Progress as plain lines (a log, not a terminal): the start, each further quarter, the end.
#[derive(Debug, Default)]
struct Lines {
    name: String,
    size: usize,
    done: usize,
    quarter: usize,
}

impl Progress for Lines {
    fn init(&mut self, size: usize, filename: &str) {
        if self.name != filename {
            eprintln!("pulling {filename} ({:.1} MB)", size as f64 / 1e6);
        }
        (self.name, self.size, self.done, self.quarter) = (filename.to_string(), size, 0, 0);
    }

    fn update(&mut self, size: usize) {
        self.done += size;
        let quarter = (self.done * 4).checked_div(self.size).unwrap_or(4);
        if quarter > self.quarter && quarter < 4 {
            eprintln!("pulling {}: {}%", self.name, quarter * 25);
        }
        self.quarter = quarter;
    }

    fn finish(&mut self) {
        eprintln!("pulled {}", self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_a_model_directory_needs_is_pulled() {
        for f in [
            "config.json",
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "chat_template.jinja",
        ] {
            assert!(needed(f), "{f}");
        }
        for f in [
            "README.md",
            "pytorch_model.bin",
            "original/consolidated.safetensors",
            "onnx/model.onnx",
            "model.gguf",
            ".gitattributes",
        ] {
            assert!(!needed(f), "{f}");
        }
    }
}
