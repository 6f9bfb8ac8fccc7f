//! A repository's file list as the hub sends it (`GET /api/models/{id}/revision/{rev}?blobs=true`), read
//! as hostile input: nothing the hub says names a file or a directory until it has the shape the cache
//! layout needs. The commit is 40 hex digits; a file's blob is named after its content hash (an LFS
//! file's sha256, 64 hex digits, else its git blob id, 40), which the download is checked against; each
//! file has a size, and files that are not weights are small.

use anyhow::{bail, Result};
use serde::Deserialize;

/// Largest file other than weights (`tokenizer.json` of Qwen3.5 is 11 MB; a config is a few KB).
pub const MAX_SMALL_FILE: u64 = 64 << 20;

/// How a file's bytes are checked once downloaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Digest {
    /// An LFS file: the sha256 of its bytes.
    Sha256(String),
    /// A file kept in git: its blob id, sha1 of `blob {size}\0` and the bytes.
    GitSha1(String),
}

impl Digest {
    /// The blob's file name in the cache (as the hub client names it: the digest in hex).
    pub fn hex(&self) -> &str {
        match self {
            Digest::Sha256(h) | Digest::GitSha1(h) => h,
        }
    }
}

/// One file to download.
#[derive(Clone, Debug)]
pub struct RemoteFile {
    /// Its name in the snapshot (one path component, checked by [`super::needed`]).
    pub name: String,
    /// Its size in bytes, as listed.
    pub size: u64,
    /// What its bytes must hash to.
    pub digest: Digest,
}

/// The checked file list: the commit and the files a model directory needs.
#[derive(Debug)]
pub struct Listing {
    /// The commit the revision points at (40 lowercase hex digits).
    pub commit: String,
    /// The files [`super::needed`] keeps, each once.
    pub files: Vec<RemoteFile>,
}

#[derive(Deserialize)]
struct RawListing {
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<RawSibling>,
}

#[derive(Deserialize)]
struct RawSibling {
    rfilename: String,
    size: Option<u64>,
    #[serde(rename = "blobId")]
    blob_id: Option<String>,
    lfs: Option<RawLfs>,
}

#[derive(Deserialize)]
struct RawLfs {
    sha256: String,
    size: u64,
}

/// Whether `s` is `len` lowercase hex digits.
pub fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The hub's answer for `id` at `revision`, checked. `revision` given as a commit must be the commit
/// listed.
pub fn parse(body: &[u8], id: &str, revision: &str) -> Result<Listing> {
    let raw: RawListing = serde_json::from_slice(body)
        .map_err(|e| anyhow::anyhow!("{id}@{revision}: the hub's file list is not the expected JSON ({e})"))?;
    let commit = raw.sha.unwrap_or_default();
    if !is_hex(&commit, 40) {
        bail!("{id}@{revision}: the hub named commit {} (not 40 hex digits); refused", shown(&commit));
    }
    if is_hex(revision, 40) && revision != commit {
        bail!("{id}@{revision}: the hub answered for another commit ({commit}); refused");
    }
    let mut files: Vec<RemoteFile> = Vec::new();
    for s in raw.siblings.into_iter().filter(|s| super::needed(&s.rfilename)) {
        if files.iter().any(|f| f.name == s.rfilename) {
            continue;
        }
        let (size, digest) = match (s.lfs, s.blob_id, s.size) {
            (Some(lfs), _, _) if is_hex(&lfs.sha256, 64) => (lfs.size, Digest::Sha256(lfs.sha256)),
            (Some(lfs), _, _) => {
                bail!("{id}: the hub lists {} with sha256 {}; refused", s.rfilename, shown(&lfs.sha256))
            }
            (None, Some(blob), Some(size)) if is_hex(&blob, 40) => (size, Digest::GitSha1(blob)),
            (None, Some(blob), Some(_)) => {
                bail!("{id}: the hub lists {} with blob id {}; refused", s.rfilename, shown(&blob))
            }
            _ => bail!(
                "{id}: the hub's file list gives no size and hash for {} (osprey checks every download against them)",
                s.rfilename
            ),
        };
        if !s.rfilename.ends_with(".safetensors") && size > MAX_SMALL_FILE {
            bail!("{id}: the hub lists {} at {size} bytes, over the {MAX_SMALL_FILE}-byte limit for a file that is not weights", s.rfilename);
        }
        files.push(RemoteFile { name: s.rfilename, size, digest });
    }
    Ok(Listing { commit, files })
}

/// A hub's string in an error: at most 80 characters, escaped.
pub fn shown(s: &str) -> String {
    let cut: String = s.chars().take(80).collect();
    let more = if s.chars().count() > 80 { "…" } else { "" };
    format!("{cut:?}{more}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const C: &str = "0123456789abcdef0123456789abcdef01234567";

    fn listing(sha: &str, siblings: &str) -> String {
        format!("{{\"sha\": \"{sha}\", \"siblings\": [{siblings}]}}")
    }

    #[test]
    fn a_listing_names_files_only_after_their_commit_hashes_and_sizes_check() {
        let lfs = format!(
            "{{\"rfilename\": \"model.safetensors\", \"lfs\": {{\"sha256\": \"{}\", \"size\": 9}}}}",
            "a".repeat(64)
        );
        let git = format!("{{\"rfilename\": \"config.json\", \"blobId\": \"{}\", \"size\": 2}}", "b".repeat(40));
        let skip = "{\"rfilename\": \"README.md\"}, {\"rfilename\": \"../x.safetensors\"}";
        let l = parse(listing(C, &format!("{lfs}, {git}, {skip}")).as_bytes(), "o/n", "main").expect("listing");
        assert_eq!(l.commit, C);
        let got: Vec<(&str, u64, &str)> = l.files.iter().map(|f| (f.name.as_str(), f.size, f.digest.hex())).collect();
        assert_eq!(
            got,
            [("model.safetensors", 9, "a".repeat(64).as_str()), ("config.json", 2, "b".repeat(40).as_str())]
        );
        for bad_commit in ["/tmp/evil", "../../../x", &C.to_uppercase(), &C[..39], ""] {
            let e = parse(listing(bad_commit, &git).as_bytes(), "o/n", "main").expect_err(bad_commit);
            assert!(e.to_string().contains("40 hex"), "{e}");
        }
        // A blob name is a digest, never a path.
        for (bad, what) in [
            ("{\"rfilename\": \"config.json\", \"blobId\": \"../../../x\", \"size\": 2}".to_string(), "blob id"),
            (
                "{\"rfilename\": \"a.safetensors\", \"lfs\": {\"sha256\": \"/etc/x\", \"size\": 2}}".to_string(),
                "sha256",
            ),
            ("{\"rfilename\": \"config.json\"}".to_string(), "no size"),
            (
                format!(
                    "{{\"rfilename\": \"config.json\", \"blobId\": \"{}\", \"size\": 99999999999}}",
                    "b".repeat(40)
                ),
                "limit",
            ),
        ] {
            let e = parse(listing(C, &bad).as_bytes(), "o/n", "main").expect_err(what);
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        // A revision given as a commit must be the one listed.
        let other = "f".repeat(40);
        assert!(parse(listing(C, &git).as_bytes(), "o/n", &other).is_err());
        assert!(parse(b"not json", "o/n", "main").is_err());
    }
}
