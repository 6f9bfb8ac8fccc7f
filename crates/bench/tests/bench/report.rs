//! `docs/benchmarks.md`'s generated block is exactly what `osprey bench report docs/runs` writes: the
//! document's run tables are regenerated from the committed JSON, never edited by hand.

use std::path::PathBuf;

use osprey_bench::report::{render, splice};

#[test]
fn the_benchmarks_document_holds_the_report_of_the_committed_runs() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/benchmarks.md")).expect("docs/benchmarks.md");
    let block = render(&root.join("docs/runs")).expect("render the runs");
    assert!(block.contains("### `2026-12-04-grammar-json-schema.json`"), "every run is rendered");
    assert_eq!(
        splice(&doc, &block).expect("markers"),
        doc,
        "docs/benchmarks.md is stale: run `osprey bench report docs/runs --update docs/benchmarks.md`"
    );
}
