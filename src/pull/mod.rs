//! Downloading a model by Hugging Face id into the standard cache (the hub client's layout:
//! `blobs/<digest>`, `snapshots/<commit>/<file>` linking to it, `refs/<revision>` holding the commit), with
//! our own HTTP client: hf-hub 0.4 named files after the hub's `etag` and `x-repo-commit` headers
//! unchecked, so a hostile hub wrote anywhere on disk, and it cannot be made safe by checking first (the
//! hub may answer differently the second time). Here everything the hub says is checked before it names
//! a file ([`listing`]), every download against its listed size and hash, every request bounded in time
//! ([`http`]). Only the files a model needs; resumable (a cut download continues from its `.part` file);
//! a progress bar on a terminal, plain lines in a log; `HF_TOKEN` (or the token file
//! `huggingface-cli login` writes) for gated repositories, sent to the hub's own address only.
//! `osprey pull ID` runs it alone; `--model ID` runs it when the id is not in the cache and
//! `HF_HUB_OFFLINE` is not set. docs/models.md, docs/reliability.md.

mod http;
mod listing;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

pub use listing::{is_hex, shown};

/// `org/name[@revision]`, when `spec` is one (and not a path that exists). A revision is a branch, tag or
/// commit: path components that are not empty, `.` or `..`.
pub(crate) fn parse_id(spec: &str) -> Option<(&str, &str, Option<&str>)> {
    let (id, rev) = match spec.split_once('@') {
        Some((id, rev)) => (id, Some(rev)),
        None => (spec, None),
    };
    let (org, name) = id.split_once('/')?;
    let word = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let rev_ok = rev.is_none_or(|r| {
        r.len() <= 256
            && r.split('/').all(|c| !c.is_empty() && c != "." && c != ".." && !c.contains(['\0', '\\']))
            && !r.contains("..")
    });
    (word(org) && word(name) && rev_ok).then_some((org, name, rev))
}

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
    /// A request that waits this long for a byte, or brings fewer than 64 KiB in this long, fails
    /// (`OSPREY_HUB_STALL_SECS`, default 30).
    pub stall: Duration,
}

impl Hub {
    /// From the environment: the cache [`cache_dir`] resolves, `HF_ENDPOINT`, `HF_TOKEN` (else
    /// the token file next to the cache).
    pub fn from_env() -> Result<Self> {
        let cache = cache_dir().context("no Hugging Face cache directory: set HF_HUB_CACHE or HF_HOME")?;
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let token = var("HF_TOKEN").or_else(|| token_file(&cache));
        let stall = match var("OSPREY_HUB_STALL_SECS") {
            Some(v) => v
                .parse::<f64>()
                .ok()
                .filter(|s| *s > 0.0 && *s < 86_400.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| anyhow!("OSPREY_HUB_STALL_SECS={v:?} is not a number of seconds"))?,
            None => Duration::from_secs(30),
        };
        Ok(Hub { cache, endpoint: var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()), token, stall })
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

/// The token `huggingface-cli login` writes (`HF_HOME/token`, the hub client's place: next to the cache).
fn token_file(cache: &Path) -> Option<String> {
    let home = std::env::var_os("HF_HOME").map(PathBuf::from).or_else(|| cache.parent().map(Path::to_path_buf))?;
    let t = std::fs::read_to_string(home.join("token")).ok()?;
    Some(t.trim().to_string()).filter(|t| !t.is_empty() && t.len() < 4096)
}

/// Downloads `org/name` at `revision` into the hub cache and returns its snapshot directory. Files
/// already there (a blob of the listed size behind the snapshot's link) are not fetched again;
/// `config.json` comes last, so a snapshot with a config is whole (what [`crate::hub::resolve_in`]
/// checks).
pub fn pull(hub: &Hub, id: &str, revision: &str) -> Result<PathBuf> {
    if parse_id(&format!("{id}@{revision}")).is_none() {
        bail!("{id}@{revision} is not a Hugging Face id (org/name, optionally @revision)");
    }
    let client = http::Client::new(hub)?;
    let body = client.listing(id, revision).map_err(|e| explain(e, id, hub.token.is_some()))?;
    let listing::Listing { commit, mut files } = listing::parse(&body, id, revision)?;
    if !files.iter().any(|f| f.name == "config.json") {
        bail!("{id}@{revision} has no config.json: not a transformers model repository");
    }
    if !files.iter().any(|f| f.name.ends_with(".safetensors")) {
        bail!("{id}@{revision} has no safetensors weights (osprey reads safetensors only)");
    }
    // The config last: its presence marks a whole snapshot.
    files.sort_by_key(|f| (f.name == "config.json", f.name.clone()));
    let repo = hub.cache.join(format!("models--{}", id.replace('/', "--")));
    let (blobs, snapshot) = (repo.join("blobs"), repo.join("snapshots").join(&commit));
    for d in [&blobs, &snapshot] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let terminal = std::io::stderr().is_terminal();
    for f in &files {
        let blob = blobs.join(f.digest.hex());
        let link = snapshot.join(&f.name);
        if std::fs::metadata(&blob).is_ok_and(|m| m.is_file() && m.len() == f.size) && link.exists() {
            continue;
        }
        let mut shown = Shown::new(terminal, &f.name);
        client
            .download((id, &commit), f, &blob, &mut |done, total| shown.update(done, total))
            .map_err(|e| explain(e, id, hub.token.is_some()))
            .with_context(|| format!("downloading {} of {id}@{revision}", f.name))?;
        shown.finish();
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("../../blobs/{}", f.digest.hex()), &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    if revision != commit {
        // The branch or tag names the commit, as the Python client records it (written whole or not at all).
        let r = repo.join("refs").join(revision);
        std::fs::create_dir_all(r.parent().unwrap_or(&repo))?;
        let tmp = repo.join("refs").join(format!(".{}.osprey-tmp", commit));
        std::fs::write(&tmp, &commit).and_then(|()| std::fs::rename(&tmp, &r))?;
    }
    tracing::info!(model = %format!("{id}@{revision}"), files = files.len(), dir = %snapshot.display(), "pulled");
    Ok(snapshot)
}

/// A hub error as what the user can do about it.
fn explain(e: anyhow::Error, id: &str, has_token: bool) -> anyhow::Error {
    match e.downcast_ref::<http::Status>().map(|s| s.0) {
        Some(401 | 403) if has_token => {
            anyhow!("{id}: the hub refused the token ({e}); the repository may be gated: accept its terms on its page")
        }
        Some(401 | 403) => anyhow!(
            "{id} is gated or private ({e}): set HF_TOKEN (or run `huggingface-cli login`) with a token that has access"
        ),
        Some(404) => anyhow!("{id}: no such model repository or revision on the hub ({e})"),
        _ => anyhow!("{id}: {e:#}"),
    }
}

/// A file's progress: a bar on a terminal, else plain lines (the start, each further quarter, the end).
struct Shown {
    name: String,
    bar: Option<indicatif::ProgressBar>,
    quarter: u64,
    started: bool,
}

impl Shown {
    fn new(terminal: bool, name: &str) -> Self {
        let bar = terminal.then(|| {
            let b = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
            if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes}") {
                b.set_style(style.progress_chars("=> "));
            }
            b.set_message(name.to_string());
            b
        });
        Shown { name: name.to_string(), bar, quarter: 0, started: false }
    }

    fn update(&mut self, done: u64, total: u64) {
        if let Some(b) = &self.bar {
            b.set_length(total);
            b.set_position(done);
            return;
        }
        if !self.started {
            self.started = true;
            let from = if done > 0 { format!(", from byte {done}") } else { String::new() };
            eprintln!("pulling {} ({:.1} MB{from})", self.name, total as f64 / 1e6);
        }
        let quarter = (done * 4).checked_div(total).unwrap_or(4);
        if quarter > self.quarter && quarter < 4 {
            eprintln!("pulling {}: {}%", self.name, quarter * 25);
        }
        self.quarter = quarter;
    }

    fn finish(&self) {
        match &self.bar {
            Some(b) => b.finish_and_clear(),
            None => eprintln!("pulled {}", self.name),
        }
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
