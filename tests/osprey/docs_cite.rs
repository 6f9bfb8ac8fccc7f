//! Issue 50: the docs that describe the code cite only what exists. `docs/architecture.md`,
//! `docs/cuda.md` and every crate's `lib.rs` overview (its `//!` lines) are read; every backticked
//! path, file, route, module, type and function they cite must exist in this repository, so a rename
//! that leaves a doc behind fails here (`a_renamed_name_or_a_moved_file_is_caught` shows the check
//! failing on both).
//!
//! What counts as a citation: a span with a `/` or a file extension is a path (relative to the
//! repository root, or the tail of a path in it; `:line` suffixes allowed; nothing outside the
//! repository); one that starts with `/` is an HTTP route the server's code names; a span with `::`,
//! a trailing `()`, or in CamelCase or UPPER_CASE is a Rust or CUDA name whose last segment must be
//! declared in our sources (a `fn`, type, module, const, field, variant or kernel). Spans with spaces
//! or operators are prose (shapes, commands, flags) and plain lowercase words are left alone (metric
//! names and fields read as words). Names of other crates are accepted by their crate (`Cargo.lock`) or
//! listed in [`EXTERNAL`] with where they come from.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The documents whose citations are checked, beside every crate's `lib.rs` overview.
const DOCS: &[&str] = &["docs/architecture.md", "docs/cuda.md"];

/// Names the docs cite from elsewhere, each with its origin.
const EXTERNAL: &[(&str, &str)] = &[
    ("Vec", "std"),
    ("Arc", "std"),
    ("Mutex", "std"),
    ("Option", "std"),
    ("Result", "std"),
    ("String", "std"),
    ("DecodeStream", "tokenizers: incremental detokenization"),
    ("ReadFixed", "io-uring: the opcode reading into registered buffers"),
    ("LruCache", "lru"),
    ("PoisonError", "std"),
    ("Read", "io-uring: the opcode reading into a plain buffer"),
    ("FADV_DONTNEED", "libc: posix_fadvise advice"),
    ("GET", "HTTP"),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every file and directory of the repository (relative, `/`-separated), and the text of its sources.
struct Repo {
    paths: BTreeSet<String>,
    source: String,
    /// Each source file's directory and text, for members of a type (declared beside the type).
    files: Vec<(String, String)>,
    crates: BTreeSet<String>,
}

fn walk(dir: &Path, base: &Path, repo: &mut Repo) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        // This file names what must not exist.
        if matches!(name.as_str(), ".git" | "target" | "node_modules" | ".venv" | "__pycache__" | "docs_cite.rs") {
            continue;
        }
        let rel = p.strip_prefix(base).expect("inside").to_string_lossy().replace('\\', "/");
        repo.paths.insert(rel.clone());
        if p.is_dir() {
            walk(&p, base, repo);
        } else if [".rs", ".cu", ".cuh", ".cpp", ".hpp", ".py", ".sh"].iter().any(|x| name.ends_with(x))
            && !rel.starts_with("fixtures/")
        {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            repo.source.push_str(&text);
            repo.source.push('\n');
            let dir = rel.rsplit_once('/').map_or("", |(d, _)| d).to_string();
            repo.files.push((dir, text));
        }
    }
}

fn repo() -> Repo {
    let mut repo = Repo { paths: BTreeSet::new(), source: String::new(), files: Vec::new(), crates: BTreeSet::new() };
    walk(&root(), &root(), &mut repo);
    let lock = std::fs::read_to_string(root().join("Cargo.lock")).expect("Cargo.lock");
    for line in lock.lines() {
        if let Some(name) = line.strip_prefix("name = \"").and_then(|l| l.strip_suffix('"')) {
            if !name.starts_with("osprey") {
                repo.crates.insert(name.replace('-', "_"));
            }
        }
    }
    repo
}

/// The documents checked: (path, text); for a `lib.rs`, its `//!` lines.
fn documents() -> Vec<(String, String)> {
    let mut docs: Vec<(String, String)> =
        DOCS.iter().map(|d| (d.to_string(), std::fs::read_to_string(root().join(d)).expect("a doc"))).collect();
    let mut libs = vec!["src/lib.rs".to_string()];
    for e in std::fs::read_dir(root().join("crates")).expect("crates/").flatten() {
        let lib = format!("crates/{}/src/lib.rs", e.file_name().to_string_lossy());
        if root().join(&lib).exists() {
            libs.push(lib);
        }
    }
    libs.sort();
    for lib in libs {
        let text = std::fs::read_to_string(root().join(&lib)).expect("lib.rs");
        let overview: Vec<&str> = text.lines().filter_map(|l| l.trim_start().strip_prefix("//!")).collect();
        docs.push((lib, overview.join("\n")));
    }
    docs
}

/// The backticked spans of `text`, outside fenced code blocks.
fn spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let parts: Vec<&str> = line.split('`').collect();
        out.extend(parts.iter().skip(1).step_by(2).take((parts.len() - 1) / 2).map(|s| s.to_string()));
    }
    out
}

#[derive(Debug, PartialEq)]
enum Cite {
    Route(String),
    Path(String),
    Name(String),
}

const EXTENSIONS: &[&str] =
    &["rs", "cu", "cuh", "cpp", "hpp", "md", "py", "sh", "toml", "json", "jsonl", "txt", "yml", "yaml", "html"];

fn classify(span: &str) -> Option<Cite> {
    let prose = |c: char| c.is_whitespace() || "=,\"'{}|*%+;!?@#$&^~[]".contains(c);
    // `.safetensors`: an extension, not a file.
    let extension = span.starts_with('.') && !span.contains('/');
    if span.is_empty() || span.chars().any(prose) || span.starts_with('-') || extension {
        return None;
    }
    if span.contains('<') && span.contains('/') {
        // `fuzz/corpus/<target>/`: a pattern of paths.
        return None;
    }
    if span.starts_with('/') && !span.starts_with("//") {
        return Some(Cite::Route(span.to_string()));
    }
    let bare = span.split(':').next().unwrap_or(span);
    let ext = bare.rsplit_once('.').map(|(_, e)| e);
    if span.contains('/') || ext.is_some_and(|e| EXTENSIONS.contains(&e)) {
        // `file.rs:12` or `file.rs:12-20`: the file.
        let path = match span.split_once(':') {
            Some((p, line)) if line.chars().all(|c| c.is_ascii_digit() || c == '-') => p,
            _ => span,
        };
        return Some(Cite::Path(path.trim_end_matches('/').to_string()));
    }
    let name = span.strip_suffix("()").unwrap_or(span);
    let name = name.split('<').next().unwrap_or(name);
    let ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !name.split("::").all(ident) || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let last = name.rsplit("::").next().unwrap_or(name);
    let upper = last.starts_with(|c: char| c.is_ascii_uppercase()) && last.len() > 1;
    (span.ends_with("()") || name.contains("::") || upper).then(|| Cite::Name(name.to_string()))
}

/// Whether `pat` occurs in `text` as whole words.
fn word(text: &str, pat: &str) -> bool {
    text.match_indices(pat).any(|(at, _)| {
        let next = text[at + pat.len()..].chars().next();
        let prev = text[..at].chars().next_back();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            && !prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Whether `text` declares `name` (one segment) as an item, a field, a variant or a kernel, or (with
/// `strings`) names it in a string the code reads (an environment variable, a tensor or its suffix).
fn declares(text: &str, name: &str, strings: bool) -> bool {
    let items = [
        "fn",
        "struct",
        "enum",
        "trait",
        "type",
        "mod",
        "const",
        "static",
        "union",
        "as",
        "void",
        "macro_rules!",
        "op",
    ];
    items.iter().any(|k| word(text, &format!("{k} {name}")))
        || word(text, &format!("pub {name}:"))
        || word(text, &format!("pub(crate) {name}:"))
        || strings && (text.contains(&format!("\"{name}\"")) || text.contains(&format!(".{name}\"")))
        || text.lines().any(|l| {
            // An enum variant: `Name,`, `Name(…)` or `Name {` at the start of a line.
            let t = l.trim_start();
            t.strip_prefix(name).is_some_and(|r| r.starts_with(',') || r.starts_with('(') || r.starts_with(" {"))
        })
}

/// Whether `name` (one segment) is declared in the sources, or is a module file; for `Type::member`, the
/// member must be declared beside the type: in a file of a directory where the type is declared or
/// implemented (a trait's methods may sit in the op groups its macro joins).
fn declared(repo: &Repo, owner: Option<&str>, name: &str) -> bool {
    if let Some(owner) = owner {
        let owns =
            |t: &str| ["struct", "enum", "trait", "impl", "for"].iter().any(|k| word(t, &format!("{k} {owner}")));
        let dirs: BTreeSet<&str> = repo.files.iter().filter(|(_, t)| owns(t)).map(|(d, _)| d.as_str()).collect();
        return repo.files.iter().any(|(d, t)| dirs.contains(d.as_str()) && declares(t, name, false));
    }
    declares(&repo.source, name, true)
        || repo.paths.iter().any(|p| p.ends_with(&format!("/{name}.rs")) || p.ends_with(&format!("/{name}")))
}

/// Why a citation names nothing in the repository (`None`: it exists).
fn missing(repo: &Repo, cite: &Cite) -> Option<String> {
    match cite {
        Cite::Route(r) => (!repo.source.contains(&format!("\"{r}\"")) && !repo.source.contains(&format!("\"{r}/")))
            .then(|| format!("route {r} is served by no code")),
        Cite::Path(p) if p.starts_with("..") || p.starts_with('/') => Some(format!("{p} is outside the repository")),
        Cite::Path(p) => {
            let found = repo.paths.contains(p)
                || repo.paths.iter().any(|f| f.ends_with(&format!("/{p}")))
                // A file a model directory holds, named by the code that reads it.
                || !p.contains('/') && repo.source.contains(&format!("\"{p}\""));
            (!found).then(|| format!("no file {p}"))
        }
        Cite::Name(n) => {
            let segs: Vec<&str> = n.split("::").collect();
            let last = segs[segs.len() - 1];
            let external = repo.crates.contains(segs[0]) && segs.len() > 1
                || segs[0] == "std"
                || EXTERNAL.iter().any(|(e, _)| *e == last);
            // `Type::member`: the member where the type is.
            let owner = (segs.len() > 1)
                .then(|| segs[segs.len() - 2])
                .filter(|o| o.starts_with(|c: char| c.is_ascii_uppercase()));
            (!external && !declared(repo, owner, last)).then(|| format!("no item {last} (cited as {n})"))
        }
    }
}

fn violations(repo: &Repo, docs: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (doc, text) in docs {
        for span in spans(text) {
            if let Some(why) = classify(&span).and_then(|c| missing(repo, &c)) {
                out.push(format!("{doc}: `{span}`: {why}"));
            }
        }
    }
    out
}

#[test]
fn every_path_and_name_the_architecture_docs_cite_exists() {
    let repo = repo();
    let docs = documents();
    let checked: usize = docs.iter().map(|(_, t)| spans(t).iter().filter_map(|s| classify(s)).count()).sum();
    assert!(checked > 300, "the docs cite {checked} things: the reader lost them");
    let bad = violations(&repo, &docs);
    assert!(bad.is_empty(), "{} citations name nothing:\n{}", bad.len(), bad.join("\n"));
}

/// The check fails where it should: a doc citing a renamed type, a removed method, a moved file, a file
/// outside the repository or an unserved route.
#[test]
fn a_renamed_name_or_a_moved_file_is_caught() {
    let repo = repo();
    let text = "`SlotTable` `SlotTables` `ExpertSource::note_hits` `crates/models/src/layers/slots.rs` \
                `crates/models/src/layers/slot.rs` `../shared/DESIGN.md` `/metrics` `/v9/nothing` `[T, k]`";
    let bad = violations(&repo, &[("t.md".into(), text.into())]);
    let named: Vec<&str> = bad.iter().map(|b| b.split('`').nth(1).expect("quoted")).collect();
    assert_eq!(
        named,
        [
            "SlotTables",
            "ExpertSource::note_hits",
            "crates/models/src/layers/slot.rs",
            "../shared/DESIGN.md",
            "/v9/nothing"
        ]
    );
}
