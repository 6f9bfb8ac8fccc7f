//! Shared helpers of the parity tests: fixture paths, reference tensors, tolerance assertions.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

use osprey_models::Model;
use safetensors::SafeTensors;

pub fn fixtures() -> PathBuf {
    // `OSPREY_FIXTURES` where the binary runs away from its build tree (the GPU kit: tools/gpu/run.sh).
    if let Some(dir) = std::env::var_os("OSPREY_FIXTURES") {
        return PathBuf::from(dir);
    }
    // The workspace root's fixtures/, from either the models crate or the root package.
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors().map(|a| a.join("fixtures")).find(|f| f.is_dir()).expect("fixtures/ above the crate")
}

pub struct Ref {
    pub bytes: Vec<u8>,
    pub meta: serde_json::Value,
    /// The file, relative to `fixtures/ref/` (what [`note_read`] records).
    pub file: String,
}

/// Appends `file tensor` to the file named by `OSPREY_FIXTURE_READS`, when set: which reference
/// tensors the tests read (tools/fixture_reads.sh; fixtures keep what a test reads and nothing more).
fn note_read(file: &str, name: &str) {
    use std::io::Write;
    if let Some(path) = std::env::var_os("OSPREY_FIXTURE_READS") {
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("reads log");
        writeln!(f, "{file} {name}").expect("write the reads log");
    }
}

impl Ref {
    pub fn load(model: &str, case: &str) -> Self {
        let dir = fixtures().join("ref").join(model);
        let bytes = std::fs::read(dir.join(format!("{case}.safetensors"))).expect("fixture file");
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).expect("summary")).expect("json");
        Ref { bytes, meta: summary["cases"][case].clone(), file: format!("{model}/{case}.safetensors") }
    }

    pub fn f32s(&self, name: &str) -> Vec<f32> {
        note_read(&self.file, name);
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let t = st.tensor(name).unwrap_or_else(|_| panic!("fixture tensor {name}"));
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        note_read(&self.file, name);
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let t = st.tensor(name).unwrap_or_else(|_| panic!("fixture tensor {name}"));
        assert_eq!(t.dtype(), safetensors::Dtype::I64, "{name}");
        t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as u32).collect()
    }
}

/// Max absolute and max relative (to the largest reference magnitude) difference.
pub fn diff(got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let abs = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-12);
    (abs, abs / scale)
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32) -> f32 {
    let (abs, rel) = diff(got, want);
    let at = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, d)| if d > m.1 { (i, d) } else { m })
        .0;
    println!("{what}: max |d| = {abs:.3e} (rel {rel:.3e}) at flat index {at}");
    assert!(abs <= atol, "{what}: max |d| = {abs:e} > {atol:e}");
    abs
}

/// Compares `got` (every position of a sequence, whole rows) with reference tensor `name` at the positions
/// the reference keeps: all of them, or those listed in `<name>.rows` (tools/trim_refs.py keeps, of a
/// free-running comparison's full-sequence tensor, the rows a test needs: a stride, the chunk and media
/// edges, the end). The rows always end at the sequence's last position, so `got` must have exactly as many
/// positions as the reference run had.
pub fn assert_rows_close(what: &str, got: &[f32], r: &Ref, name: &str, atol: f32) -> f32 {
    let want = r.f32s(name);
    let rows_name = format!("{name}.rows");
    if !r.has(&rows_name) {
        return assert_close(what, got, &want, atol);
    }
    let rows: Vec<usize> = r.i64s(&rows_name).into_iter().map(|p| p as usize).collect();
    let dim = want.len() / rows.len();
    assert_eq!(got.len() % dim, 0, "{what}: {} values are not whole rows of {dim}", got.len());
    let n = got.len() / dim;
    assert_eq!(rows.last(), Some(&(n - 1)), "{what}: the reference's last row is position {}", n - 1);
    let picked: Vec<f32> = rows.iter().flat_map(|&p| got[p * dim..(p + 1) * dim].iter().copied()).collect();
    assert_close(&format!("{what} ({} of {n} rows)", rows.len()), &picked, &want, atol)
}

/// A fixture model on the exact CPU backend (f32 activations everywhere): what parity is measured on.
pub fn model(name: &str) -> Model {
    osprey_models::load_on(&fixtures().join("models").join(name), osprey_backend_cpu::CpuBackend::exact())
        .expect("load model")
}

/// The vision tower of fixture model `name` on the exact backend (what parity is measured on).
pub fn tower(name: &str) -> osprey_models::vision::VisionTower {
    let dir = fixtures().join("models").join(name);
    osprey_models::vision::VisionTower::from_dir(&dir, osprey_backend_cpu::CpuBackend::exact())
        .expect("load the tower")
        .expect("the model has a vision tower")
}

impl Ref {
    /// Raw little-endian bytes of a tensor with its dtype.
    pub fn raw(&self, name: &str) -> (safetensors::Dtype, Vec<usize>, Vec<u8>) {
        note_read(&self.file, name);
        let st = SafeTensors::deserialize(&self.bytes).expect("safetensors");
        let t = st.tensor(name).unwrap_or_else(|_| panic!("fixture tensor {name}"));
        (t.dtype(), t.shape().to_vec(), t.data().to_vec())
    }

    /// Whether the fixture has a tensor.
    pub fn has(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.bytes).expect("safetensors").tensor(name).is_ok()
    }

    /// An int64 tensor as i64 values.
    pub fn i64s(&self, name: &str) -> Vec<i64> {
        let (d, _, b) = self.raw(name);
        assert_eq!(d, safetensors::Dtype::I64, "{name}");
        b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
    }

    /// Reads a file of `fixtures/ref/` that is not per model.
    pub fn load_file(file: &str) -> Self {
        let bytes = std::fs::read(fixtures().join("ref").join(file)).expect("fixture file");
        Ref { bytes, meta: serde_json::Value::Null, file: file.to_string() }
    }
}

/// A scratch directory for this test binary, emptied first: under cargo's per-target tmp dir and
/// named after the test crate and `tag`, so reruns reuse one directory instead of leaving one per
/// process in /tmp (cargo runs test binaries one at a time).
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{}-{tag}", env!("CARGO_CRATE_NAME")));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// Log-probabilities of one row of logits, in f64.
pub fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = l.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    l.iter().map(|&v| v as f64 - lse).collect()
}

/// How far one path's logits drift from a reference path's, step by step (teacher forced): the largest
/// |Δlogprob| over the vocabulary, the largest on the reference's top token, and top-1 agreements.
#[derive(Debug, Default)]
pub struct Drift {
    pub worst: f64,
    pub worst_top: f64,
    pub agree: usize,
    pub steps: usize,
}

impl Drift {
    /// Adds one step: `exact` is the reference path's logits, `other` the drifting path's.
    pub fn add(&mut self, exact: &[f32], other: &[f32]) {
        let (pe, po) = (log_softmax(exact), log_softmax(other));
        self.worst = pe.iter().zip(&po).map(|(a, b)| (a - b).abs()).fold(self.worst, f64::max);
        let top = |p: &[f64]| p.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).unwrap_or(0);
        self.agree += usize::from(top(&pe) == top(&po));
        self.worst_top = self.worst_top.max((pe[top(&pe)] - po[top(&pe)]).abs());
        self.steps += 1;
    }
}
