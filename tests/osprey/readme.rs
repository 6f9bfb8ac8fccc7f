//! The README's and docs/api.md's requests and answers, checked against the binary (issue 37: the README
//! had drifted from what the retrained default model says). Every `sh` block of either that sends a
//! `curl` request is sent, as written (its `$IMG` is the file its `IMG=$(base64 -w0 FILE)` line names), to
//! the embedded model served with `osprey serve`'s defaults, and the `json` block after it is the answer:
//! the chat message (`choices[0].message`), the Messages content, or the Ollama message or response.
//! Greedy decoding is deterministic, so the comparison is exact.

use crate::harness;

use std::path::PathBuf;

use base64::Engine as _;
use osprey::Settings;
use serde_json::Value;

struct Example {
    path: String,
    body: Value,
    answer: Value,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The README's request blocks, each with the answer block after it.
fn examples(readme: &str) -> Vec<Example> {
    let mut blocks: Vec<(String, String)> = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in readme.lines() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(lang)) => open = Some((lang.trim().to_string(), String::new())),
            (Some(_), Some(_)) => blocks.push(open.take().expect("open block")),
            (Some((_, text)), None) => {
                text.push_str(line);
                text.push('\n');
            }
            (None, None) => {}
        }
    }
    let mut out = Vec::new();
    for (i, (lang, text)) in blocks.iter().enumerate() {
        if lang != "sh" || !text.contains("curl ") {
            continue;
        }
        let image = text.lines().find_map(|l| l.strip_prefix("IMG=$(base64 -w0 ")?.strip_suffix(')'));
        let path = text
            .split("http://127.0.0.1:8080")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .expect("a request to the README's server")
            .to_string();
        let quoted = text.split_once("-d '").map(|(_, b)| b.trim_end()).expect("a -d body");
        let mut body = quoted.strip_suffix('\'').expect("the body's closing quote").to_string();
        if let Some(file) = image {
            let bytes = std::fs::read(root().join(file)).expect("the README's image");
            body = body.replace("'\"$IMG\"'", &base64::engine::general_purpose::STANDARD.encode(bytes));
        }
        let body: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: the body is not JSON: {e}"));
        let answer = blocks[i + 1..]
            .iter()
            .take_while(|(l, _)| l != "sh")
            .find(|(l, _)| l == "json")
            .map(|(_, t)| serde_json::from_str(t).expect("the answer block is JSON"))
            .unwrap_or_else(|| panic!("{path}: no json answer block after the request"));
        out.push(Example { path, body, answer });
    }
    out
}

#[test]
fn every_request_in_the_readme_and_the_api_doc_gets_the_answer_they_show() {
    // `osprey serve` with no flags: the embedded model, the default settings.
    let dir = osprey::model_dir(&Settings::default()).expect("the embedded model");
    let addr = harness::start(Settings::default(), dir);
    for (doc, least) in [("README.md", 3), ("docs/api.md", 2)] {
        let text = std::fs::read_to_string(root().join(doc)).expect(doc);
        let examples = examples(&text);
        assert!(examples.len() >= least, "{doc}'s examples were not found ({} of at least {least})", examples.len());
        for e in examples {
            let (status, v) = harness::post(addr, &e.path, &e.body.to_string(), None);
            assert_eq!(status, 200, "{doc} {}: {v}", e.path);
            // The part of the answer a document shows: the message, the Messages content, the Ollama message
            // or response (its timings change from run to run).
            let got = match e.path.as_str() {
                "/v1/messages" => &v["content"],
                "/api/chat" => &v["message"],
                "/api/generate" => &v["response"],
                _ => &v["choices"][0]["message"],
            };
            assert_eq!(got, &e.answer, "{doc} {}: the document shows {}, the binary answers {got}", e.path, e.answer);
        }
    }
}

/// The figures of a line: numbers with a unit (`1.50×`, `19–28%`, `230 µs`, `10.1 MB`) or in e-notation
/// (`4.2e-5`), each number of a range on its own.
fn figures(line: &str) -> Vec<String> {
    let units = ["×", "%", " µs", " ms", " MB", " GB", " tok/s"];
    let chars: Vec<(usize, char)> = line.char_indices().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let (at, c) = chars[i];
        let starts =
            c.is_ascii_digit() && (i == 0 || !(chars[i - 1].1.is_ascii_alphanumeric() || chars[i - 1].1 == '.'));
        if !starts {
            i += 1;
            continue;
        }
        // A number, `-`/`–` and another, as far as they go.
        let mut end = i;
        while end < chars.len() && (chars[end].1.is_ascii_digit() || ".e-–".contains(chars[end].1)) {
            end += 1;
        }
        let to = chars.get(end).map_or(line.len(), |c| c.0);
        let text = line[at..to].trim_end_matches(['.', '-', '–']);
        let rest = &line[at + text.len()..];
        if text.contains("e-") || units.iter().any(|u| rest.starts_with(u)) {
            out.extend(text.split(['–']).filter(|n| !n.is_empty()).map(str::to_string));
        }
        i = end.max(i + 1);
    }
    out
}

/// Every figure the README's status table states is recorded in docs/ (a benchmark run, or the doc of
/// the test that measures it), so a figure cannot be typed in by hand and drift.
#[test]
fn every_figure_in_the_readme_status_table_is_recorded_in_the_docs() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    let mut docs = String::new();
    for e in std::fs::read_dir(root().join("docs")).expect("docs/").flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            docs.push_str(&std::fs::read_to_string(e.path()).expect("a doc"));
        }
    }
    let recorded = |n: &str| {
        docs.match_indices(n).any(|(at, _)| {
            let before = docs[..at].chars().next_back();
            let after = docs[at + n.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit() || c == '.') && !after.is_some_and(|c| c.is_ascii_digit())
        })
    };
    let rows: Vec<&str> = readme.lines().filter(|l| l.starts_with("| ")).collect();
    let all: Vec<String> = rows.iter().flat_map(|l| figures(l)).collect();
    assert!(all.len() > 20, "the status table's figures were not found: {all:?}");
    let missing: Vec<&String> = all.iter().filter(|n| !recorded(n)).collect();
    assert!(missing.is_empty(), "README figures recorded nowhere in docs/: {missing:?}");
    assert_eq!(figures("prefill 1.50× and 19–28%, 230 µs, ≤ 4.2e-5, 3 layers"), ["1.50", "19", "28", "230", "4.2e-5"]);
}
