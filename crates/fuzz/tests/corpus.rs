//! Replays the committed seed corpus (`fuzz/corpus/<target>/`, including every input a fuzzing run found
//! to crash, kept after the fix) through each target: what libFuzzer starts from is checked on every
//! `cargo test`, and a fixed crash stays fixed.

#[test]
fn every_seed_runs_through_its_target() {
    let root = osprey_fuzz::repo_root().join("fuzz/corpus");
    for (name, target) in osprey_fuzz::TARGETS {
        let dir = root.join(name);
        let mut n = 0;
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("seed");
            eprintln!("{name}: {}", path.display());
            target(&data);
            n += 1;
        }
        assert!(n >= 3, "the {name} corpus has {n} seeds");
    }
}
