//! Models named by Hugging Face id (`org/name`, optionally `@revision`), as vLLM and SGLang take them:
//! resolved from the standard Hugging Face cache that `huggingface-cli download`, transformers and
//! vLLM fill (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`), in the hub client's layout: `models--org--name/refs/<branch or tag>` holds
//! a commit, `snapshots/<commit>/` the files (links into `blobs/`). A path that exists is a model
//! directory as before. docs/models.md.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::pull::parse_id;

/// The name a model given by id is served under: `org/name` (as vLLM and SGLang list it), not the
/// snapshot directory's commit hash. `None` for a directory.
pub fn served_name(spec: &Path) -> Option<String> {
    if spec.exists() {
        return None;
    }
    spec.to_str().and_then(parse_id).map(|(org, name, _)| format!("{org}/{name}"))
}

fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "yes" | "on"))
}

/// The model directory `spec` names: a directory that exists, or a Hugging Face id found in the cache,
/// else downloaded into it ([`crate::pull`]) unless `HF_HUB_OFFLINE` is set.
pub fn resolve(spec: &Path) -> Result<PathBuf> {
    let offline = offline();
    let found = resolve_in(spec, crate::pull::cache_dir().as_deref(), offline);
    match (&found, spec.to_str().and_then(parse_id)) {
        (Err(_), Some((org, name, rev))) if !offline && !spec.exists() => download(org, name, rev),
        _ => found,
    }
}

/// `org/name` at `rev` (default `main`) downloaded into the cache ([`crate::pull`]).
fn download(org: &str, name: &str, rev: Option<&str>) -> Result<PathBuf> {
    crate::pull::pull(&crate::pull::Hub::from_env()?, &format!("{org}/{name}"), rev.unwrap_or("main"))
}

/// `osprey pull ID`: the snapshot of `id` (`org/name[@revision]`), downloaded unless the cache has it.
pub fn pull_id(id: &str) -> Result<PathBuf> {
    let Some((org, name, rev)) = parse_id(id) else {
        bail!("{id} is not a Hugging Face id (org/name, optionally @revision)");
    };
    if offline() {
        return resolve_in(Path::new(id), crate::pull::cache_dir().as_deref(), true);
    }
    download(org, name, rev)
}

/// [`resolve`] with the cache and the offline switch given (tests).
pub fn resolve_in(spec: &Path, cache: Option<&Path>, offline: bool) -> Result<PathBuf> {
    if spec.is_dir() {
        return Ok(spec.to_path_buf());
    }
    let Some((org, name, rev)) = spec.to_str().and_then(parse_id) else {
        bail!("{} is not a model directory (nor a Hugging Face id such as Qwen/Qwen3.6-35B-A3B)", spec.display());
    };
    let cache = cache.context("no Hugging Face cache directory: set HF_HUB_CACHE or HF_HOME")?;
    let repo = cache.join(format!("models--{org}--{name}"));
    let rev = rev.unwrap_or("main");
    let commit = if rev.len() == 40 && rev.chars().all(|c| c.is_ascii_hexdigit()) {
        rev.to_string()
    } else {
        match std::fs::read_to_string(repo.join("refs").join(rev)) {
            Ok(c) => c.trim().to_string(),
            Err(_) => return Err(missing(org, name, rev, &repo, offline)),
        }
    };
    // A ref is a commit, never a path (a cache written by a hostile hub through an older client held
    // absolute and `../` commits here).
    if !crate::pull::is_hex(&commit.to_ascii_lowercase(), 40) {
        bail!(
            "{org}/{name}@{rev}: refs/{rev} in the cache holds {}, not a commit; refused",
            crate::pull::shown(&commit)
        );
    }
    let snapshot = repo.join("snapshots").join(&commit);
    if !snapshot.join("config.json").is_file() {
        return Err(missing(org, name, rev, &repo, offline));
    }
    tracing::info!(model = %format!("{org}/{name}@{rev}"), commit = %commit, dir = %snapshot.display(), "from the Hugging Face cache");
    Ok(snapshot)
}

fn missing(org: &str, name: &str, rev: &str, repo: &Path, offline: bool) -> anyhow::Error {
    let id = format!("{org}/{name}@{rev}");
    if offline {
        anyhow::anyhow!("{id} is not in the Hugging Face cache ({}) and HF_HUB_OFFLINE is set", repo.display())
    } else {
        anyhow::anyhow!("{id} is not in the Hugging Face cache ({}); `osprey pull {id}` downloads it", repo.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache laid out as the hub client lays it out: blobs, a snapshot of links to them, a ref.
    fn cache_with(tag: &str, files: &[(&str, &[u8])], commit: &str, refs: &[&str]) -> PathBuf {
        let cache = std::env::temp_dir().join(format!("osprey-hub-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let repo = cache.join("models--Org--tiny-model");
        let snap = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(repo.join("blobs")).expect("blobs");
        std::fs::create_dir_all(&snap).expect("snapshot");
        std::fs::create_dir_all(repo.join("refs")).expect("refs");
        for (i, (name, bytes)) in files.iter().enumerate() {
            let blob = format!("blob{i}");
            std::fs::write(repo.join("blobs").join(&blob), bytes).expect("blob");
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(name)).expect("link");
        }
        for r in refs {
            std::fs::write(repo.join("refs").join(r), commit).expect("ref");
        }
        cache
    }

    const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

    #[test]
    fn an_id_resolves_to_its_snapshot_by_branch_tag_or_commit() {
        let cache = cache_with("ok", &[("config.json", b"{}")], COMMIT, &["main", "v1"]);
        let snap = cache.join("models--Org--tiny-model/snapshots").join(COMMIT);
        for spec in ["Org/tiny-model", "Org/tiny-model@main", "Org/tiny-model@v1", &format!("Org/tiny-model@{COMMIT}")]
        {
            assert_eq!(resolve_in(Path::new(spec), Some(&cache), false).expect(spec), snap, "{spec}");
        }
        let _ = std::fs::remove_dir_all(&cache);
    }

    /// Issue 49: a ref that holds a path (written by a hostile hub through hf-hub 0.4) is refused, not
    /// followed out of the cache.
    #[test]
    fn a_ref_that_is_not_a_commit_is_refused() {
        for evil in ["/tmp", "../../../../tmp", "../snapshots/x"] {
            let cache = cache_with("evil", &[("config.json", b"{}")], COMMIT, &["main"]);
            std::fs::write(cache.join("models--Org--tiny-model/refs/main"), evil).expect("ref");
            let e = resolve_in(Path::new("Org/tiny-model"), Some(&cache), true).expect_err(evil);
            assert!(e.to_string().contains("not a commit"), "{e}");
            let _ = std::fs::remove_dir_all(&cache);
        }
    }

    #[test]
    fn what_is_not_in_the_cache_says_so_and_paths_stay_paths() {
        let cache = cache_with("miss", &[("config.json", b"{}")], COMMIT, &["main"]);
        let e = resolve_in(Path::new("Org/tiny-model@dev"), Some(&cache), true).expect_err("no such ref");
        assert!(e.to_string().contains("HF_HUB_OFFLINE"), "{e}");
        let e = resolve_in(Path::new("Other/model"), Some(&cache), false).expect_err("not cached");
        assert!(e.to_string().contains("osprey pull Other/model"), "{e}");
        // A snapshot without config.json (an interrupted download) is not a model.
        let bare = cache_with("bare", &[("tokenizer.json", b"{}")], COMMIT, &["main"]);
        assert!(resolve_in(Path::new("Org/tiny-model"), Some(&bare), false).is_err());
        // An existing directory is a path, even when it looks like an id; nonsense is neither.
        assert_eq!(resolve_in(&cache, Some(&cache), false).expect("dir"), cache);
        for bad in
            ["no-slash", "a/b/c", "../x", "Org/tiny-model@../../etc", "Org/tiny-model@a/./b", "Org/tiny-model@a//b"]
        {
            assert!(resolve_in(Path::new(bad), Some(&cache), false).is_err(), "{bad}");
        }
        let _ = std::fs::remove_dir_all(&cache);
        let _ = std::fs::remove_dir_all(&bare);
    }
}
