//! The house rules a reader can rely on (issue 34), checked on the sources: no loop between the modules
//! of a crate, and no function outside the SIMD kernels longer than 100 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())).flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The source directories of the workspace's crates (the root package's `src` included).
fn source_dirs() -> Vec<PathBuf> {
    let mut dirs = vec![root().join("src")];
    for e in std::fs::read_dir(root().join("crates")).expect("crates/").flatten() {
        if e.path().join("src").is_dir() {
            dirs.push(e.path().join("src"));
        }
    }
    dirs.sort();
    dirs
}

/// `text` without its comment lines and its inline test module (`#[cfg(test)] mod tests { … }`, which may
/// use anything in the crate).
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or(text);
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// Identifiers following each `crate::` in `text`.
fn crate_paths(text: &str) -> Vec<String> {
    text.match_indices("crate::")
        .filter(|(i, _)| !text[..*i].ends_with(|c: char| c.is_alphanumeric() || c == '_'))
        .map(|(i, m)| text[i + m.len()..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect())
        .collect()
}

/// One crate's module graph: each top-level module (a file or directory beside `lib.rs`/`main.rs`) and
/// the top-level modules its code names through `crate::` (directly or through a `pub use` of `lib.rs`).
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for e in std::fs::read_dir(src).expect("src").flatten() {
        let p = e.path();
        let name = p.file_stem().and_then(|s| s.to_str()).unwrap_or_default().to_string();
        if p.is_dir() {
            files.insert(name, rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") && name != "lib" && name != "main" {
            files.entry(name).or_default().push(p);
        }
    }
    // `pub use module::{A, B}` / `pub use module::A` in lib.rs: `crate::A` means `module`.
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap_or_default();
    let mut reexported = BTreeMap::new();
    for stmt in code(&lib).split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else { continue };
        let Some((module, names)) = rest.split_once("::") else { continue };
        for n in names.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|n| !n.is_empty()) {
            reexported.insert(n.to_string(), module.to_string());
        }
    }
    let mut graph = BTreeMap::new();
    for (m, paths) in &files {
        let mut deps = BTreeSet::new();
        for p in paths.iter().filter(|p| p.file_name().is_some_and(|f| f != "tests.rs")) {
            let text = code(&std::fs::read_to_string(p).expect("source"));
            for id in crate_paths(&text) {
                let target = if files.contains_key(&id) { Some(&id) } else { reexported.get(&id) };
                if let Some(t) = target.filter(|t| *t != m) {
                    deps.insert(t.clone());
                }
            }
        }
        graph.insert(m.clone(), deps);
    }
    graph
}

fn reaches(graph: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.to_string()];
    while let Some(m) = stack.pop() {
        if m == to {
            return true;
        }
        if seen.insert(m.clone()) {
            stack.extend(graph.get(&m).into_iter().flatten().cloned());
        }
    }
    false
}

/// Edges `a → b` of a crate's module graph where `b` also reaches `a`.
fn loops(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for (a, deps) in graph {
        for b in deps.iter().filter(|b| reaches(graph, b, a)) {
            out.push(format!("{a} -> {b}"));
        }
    }
    out
}

#[test]
fn no_module_of_a_crate_reaches_back_to_itself() {
    let mut found = Vec::new();
    for src in source_dirs() {
        let graph = module_graph(&src);
        for l in loops(&graph) {
            found.push(format!("{}: {l}", src.strip_prefix(root()).unwrap_or(&src).display()));
        }
    }
    assert!(found.is_empty(), "module loops:\n{}", found.join("\n"));
    // The check itself: a crate whose two modules name each other is a loop.
    let g: BTreeMap<String, BTreeSet<String>> = [("a", "b"), ("b", "a"), ("c", "a")]
        .iter()
        .map(|(m, d)| (m.to_string(), BTreeSet::from([d.to_string()])))
        .collect();
    assert_eq!(loops(&g), ["a -> b", "b -> a"]);
    assert_eq!(crate_paths("use crate::x::Y; my_crate::z; crate::w"), ["x", "w"]);
}

/// Functions of `text` longer than `max` lines: (first line, name, lines). A function ends at the first
/// line after its signature that closes its indentation (`}`, or `};` for a body inside a macro table).
fn long_functions(text: &str, max: usize) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let body = l.trim_start();
        let indent = &l[..l.len() - body.len()];
        let words: Vec<&str> = body.split_whitespace().collect();
        let Some(at) = words.iter().position(|w| *w == "fn") else { continue };
        let qualifiers = ["pub", "pub(crate)", "pub(super)", "const", "async", "unsafe", "extern", "\"C\""];
        if !words[..at].iter().all(|w| qualifiers.contains(w)) {
            continue;
        }
        // The signature ends at its `{` (a body) or `;` (a declaration).
        let Some(open) = (i..lines.len()).find(|&j| lines[j].trim_end().ends_with(['{', ';'])) else { continue };
        if !lines[open].trim_end().ends_with('{') {
            continue;
        }
        let closes = |s: &str| [format!("{indent}}}"), format!("{indent}}};")].iter().any(|c| s.trim_end() == c);
        let Some(end) = (open + 1..lines.len()).find(|&j| closes(lines[j])) else { continue };
        let name = words.get(at + 1).map(|w| w.split(['(', '<']).next().unwrap_or(w)).unwrap_or_default();
        if end - i + 1 > max {
            out.push((i + 1, name.to_string(), end - i + 1));
        }
    }
    out
}

#[test]
fn no_function_outside_the_simd_kernels_is_longer_than_100_lines() {
    let kernels = [root().join("crates/kernels"), root().join("crates/backend-cpu")];
    let mut dirs = source_dirs();
    dirs.push(root().join("tests"));
    for e in std::fs::read_dir(root().join("crates")).expect("crates/").flatten() {
        if e.path().join("tests").is_dir() {
            dirs.push(e.path().join("tests"));
        }
    }
    let mut long = Vec::new();
    for dir in dirs.iter().filter(|d| !kernels.iter().any(|k| d.starts_with(k))) {
        for p in rust_files(dir) {
            for (line, name, n) in long_functions(&std::fs::read_to_string(&p).expect("source"), 100) {
                long.push(format!("{}:{line} {name}: {n} lines", p.strip_prefix(root()).unwrap_or(&p).display()));
            }
        }
    }
    assert!(long.is_empty(), "functions over 100 lines:\n{}", long.join("\n"));
    // The check itself, on a function of 101 lines and one of 100.
    let body =
        |n: usize| format!("    pub fn f(\n        x: u8,\n    ) -> u8 {{\n{}    }}\n", "        x;\n".repeat(n - 4));
    assert_eq!(long_functions(&body(101), 100), [(1, "f".to_string(), 101)]);
    assert!(long_functions(&body(100), 100).is_empty());
}
