//! Shared test pieces: the two backends, seeded data, owned host weights, comparisons with bounds.

use std::sync::Arc;

use osprey_backend::{BackendRef, DType, HostMatrix, WeightView};

/// The exact CPU backend (f32 activations: the reference) and the CUDA backend on the emulated device,
/// or on the real one named by `OSPREY_CUDA_TEST_DEVICE=cuda:N` (how the GPU kit runs these tests).
pub fn backends() -> (BackendRef, BackendRef) {
    (osprey_backend_cpu::CpuBackend::exact(), cuda())
}

/// Whether the tests run on a real device (`OSPREY_CUDA_TEST_DEVICE`): its `expf` is not glibc's, so
/// results the emulated device matches to the bit through a transcendental function are held to the
/// function's error bound there instead.
pub fn on_device() -> bool {
    std::env::var("OSPREY_CUDA_TEST_DEVICE").is_ok_and(|d| d.starts_with("cuda:"))
}

/// The CUDA backend under test (see [`backends`]).
pub fn cuda() -> BackendRef {
    osprey_backend_cuda::open_test_device(4 << 30)
}

/// `n` values in [-1, 1) from a seeded generator.
pub fn data(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `n` bytes from a seeded generator.
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    data(seed, n).iter().map(|v| ((v + 1.0) * 127.99) as u8).collect()
}

/// A weight matrix owned by the test.
#[derive(Debug)]
pub enum Owned {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    F16(Vec<u16>),
    Nvfp4 { packed: Vec<u8>, scales: Vec<u8>, global: f32 },
}

/// A weight of `rows × cols` in that storage.
#[derive(Debug)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Owned,
}

impl HostMatrix for Matrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn dtype(&self) -> DType {
        match self.data {
            Owned::F32(_) => DType::F32,
            Owned::Bf16(_) => DType::BF16,
            Owned::F16(_) => DType::F16,
            Owned::Nvfp4 { .. } => DType::Nvfp4,
        }
    }
    fn bytes(&self) -> usize {
        match &self.data {
            Owned::F32(v) => 4 * v.len(),
            Owned::Bf16(v) | Owned::F16(v) => 2 * v.len(),
            Owned::Nvfp4 { packed, scales, .. } => packed.len() + scales.len(),
        }
    }
    fn view(&self) -> WeightView<'_> {
        match &self.data {
            Owned::F32(v) => WeightView::F32(v),
            Owned::Bf16(v) => WeightView::Bf16(v),
            Owned::F16(v) => WeightView::F16(v),
            Owned::Nvfp4 { packed, scales, global } => WeightView::Nvfp4 { packed, scales, global: *global },
        }
    }
}

/// A seeded weight of `dtype`: values in [-1, 1) (NVFP4: random codes, e4m3 scales between 2^-4 and 2).
pub fn weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> Arc<Matrix> {
    let v = data(seed, rows * cols);
    let data = match dtype {
        DType::F32 => Owned::F32(v),
        DType::BF16 => Owned::Bf16(v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()),
        DType::F16 => Owned::F16(v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()),
        DType::Nvfp4 => Owned::Nvfp4 {
            packed: bytes(seed, rows * cols / 2),
            // e4m3 codes 0x18..0x40: exponents 3..8, values 2^-4 .. 2.
            scales: bytes(seed + 1, rows * cols / 16).iter().map(|b| 0x18 + b % 0x28).collect(),
            global: 0.75,
        },
        other => panic!("no {other:?} weights"),
    };
    Arc::new(Matrix { rows, cols, data })
}

/// Row `r` of a weight, as f32 (NVFP4 dequantised as the CPU dequantises it).
pub fn row(m: &Matrix, r: usize) -> Vec<f32> {
    let (k, s) = (m.cols, r * m.cols);
    match &m.data {
        Owned::F32(v) => v[s..s + k].to_vec(),
        Owned::Bf16(v) => v[s..s + k].iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect(),
        Owned::F16(v) => v[s..s + k].iter().map(|&b| half::f16::from_bits(b).to_f32()).collect(),
        Owned::Nvfp4 { packed, scales, global } => {
            let mut out = vec![0f32; k];
            osprey_kernels::nvfp4::dequant_row(
                &packed[s / 2..(s + k) / 2],
                &scales[s / 16..(s + k) / 16],
                *global,
                &mut out,
            );
            out
        }
    }
}

/// Unit roundoff of f32.
pub const U: f32 = f32::EPSILON / 2.0;

/// Asserts `|got − want| ≤ bound[i]` everywhere, naming the worst element.
pub fn within(what: &str, got: &[f32], want: &[f32], bound: impl Fn(usize) -> f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let b = bound(i);
        assert!((g - w).abs() <= b || (g.is_nan() && w.is_nan()), "{what}[{i}]: {g} vs {w} (bound {b:e})");
    }
}
