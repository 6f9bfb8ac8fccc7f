//! `y[m, n] = x[m, k] · W[n, k]ᵀ` for weights in f32, bf16, f16 or NVFP4 (the layout of `nn.Linear.weight`).
//!
//! Two regimes (the split point is [`GEMV_MAX_ROWS`], or [`q8_gemv_max_rows`] for NVFP4 on the int8 path):
//! - few rows (decode): memory-bound, so each weight row is read once from DRAM, widened in registers and
//!   dotted with every input row while it sits in L1;
//! - many rows (prefill): compute-bound, so each tile of weight rows is widened once into an f32 scratch
//!   tile and multiplied with matrixmultiply's sgemm (AVX2/FMA microkernels).
//!
//! At the fast precision ([`Precision::Int8`]) NVFP4 rows take int8 activations: the per-row integer
//! dots ([`crate::q8`]) in the first regime, the int8 GEMM ([`crate::q8_gemm`], AVX-512 VNNI or AVX2)
//! in the second, whose rows below [`INT8_GEMV_BELOW_ROWS`] run on [`crate::q8_gemv`] where AVX-512 VNNI
//! is (a decode batch: the same bits, 16 weight rows transposed in registers); on CPUs with AVX512-BF16
//! bf16 weights (both regimes) and NVFP4 weights without VNNI (second regime) take bf16-rounded
//! activations on [`crate::bf16`] tiles. `--gemm` ([`crate::set_gemm_ceiling`])
//! can forbid the faster GEMMs, to measure or to force a fallback.
//!
//! Both split the output columns (weight rows) across the kernels' [`crate::pool`].

pub use osprey_backend::types::{DType, Precision, WeightView};

use crate::dispatch::{allowed, allowed_for, Gemm, Rows, WeightClass};
use crate::pool::OutPtr;
use crate::q8::{self, Isa, Q8Act};
use crate::{amx, bf16, nvfp4, pool, q8_gemm, q8_gemv, simd};

/// Up to this many input rows a matmul takes the GEMV path.
pub const GEMV_MAX_ROWS: usize = 4;

/// Up to this many rows an NVFP4 matmul with int8 activations stays on the integer dot path (each
/// weight row read once, dotted with every row), on a CPU without bf16 tiles: there the GEMM widens
/// weights to f32 for sgemm, and a prefill chunk's routed experts (~16 rows each) are faster on the dot
/// path (measured crossover ~32).
pub const Q8_GEMV_MAX_ROWS: usize = 32;

/// The same limit where the GEMM runs on bf16 tiles: decoding an NVFP4 tile to bf16 costs little and
/// the tiles do 32 multiply-adds per instruction, so the integer path only wins for a handful of rows
/// (512-token prefill on q35moe-L4 NVFP4: 220 tok/s at a limit of 32, 270 at 16, 300 at 8 and at 4).
pub const Q8_GEMV_MAX_ROWS_WITH_BF16: usize = 8;

/// The same limit where the int8 GEMM runs ([`q8_gemm`], AVX-512 VNNI): it decodes a weight tile once
/// for all rows and does 64 multiply-adds per instruction with no horizontal sums, so it wins from 3
/// rows on (expert gate/up 512×2048, 2 threads, `timing::gemm_vs`: 1 row 0.028 ms on the dot path vs
/// 0.045; 2 rows 0.050 vs 0.047, a tie kept on the dot path; 3 rows 0.074 vs 0.050; 8 rows 0.20 vs 0.072).
/// The AVX2 GEMM crosses at the same place (Zen 3, 2 threads: 2 rows 0.087 vs 0.120 ms and, down
/// 2048×512, 0.076 vs 0.081; 3 rows 0.123 vs 0.101 and 0.112 vs 0.090).
pub const Q8_GEMV_MAX_ROWS_WITH_INT8_GEMM: usize = 2;

/// The same limit where the int8 GEMM takes few rows on [`q8_gemv`] (AVX-512 VNNI): one row only. At
/// two rows the GEMV reads each weight once for both and sums no lanes horizontally (`timing::gemm_vs`,
/// 2 threads: expert gate/up 512×2048 0.023 ms against 0.051 on the dot path, down 2048×512 0.024
/// against 0.049); at one row the two are even or the dot path streams faster (`timing::dense_rows`,
/// cold: 32768×2048 21.1 GB/s against 17.5; `timing::expert_wave`: 17.2 against 16.4).
pub const Q8_GEMV_MAX_ROWS_WITH_INT8_GEMV: usize = 1;

/// Below this many rows the int8 GEMM's rows run on [`q8_gemv`] where the CPU has it (the same bits):
/// at 4–8 rows it streams the weights 1.3–1.6× faster than the GEMM's interleaved tile (`timing::
/// dense_rows`, cold, 2 threads: 8192×2048 at 8 rows 0.68 ms against 0.91, 2048×4096 0.32 against 0.47);
/// at 16 rows they are within 10% and AMX tiles take over where granted ([`AMX_MIN_ROWS`]).
pub const INT8_GEMV_BELOW_ROWS: usize = 16;

/// The row limit of the integer dot path on this CPU.
pub fn q8_gemv_max_rows() -> usize {
    if q8_gemv::available() && allowed_for(WeightClass::Nvfp4, Rows::Few, Gemm::Int8) {
        Q8_GEMV_MAX_ROWS_WITH_INT8_GEMV
    } else if q8_gemm::available() && allowed_for(WeightClass::Nvfp4, Rows::Few, Gemm::Int8) {
        Q8_GEMV_MAX_ROWS_WITH_INT8_GEMM
    } else if bf16::available() && allowed_for(WeightClass::Nvfp4, Rows::Few, Gemm::Bf16) {
        Q8_GEMV_MAX_ROWS_WITH_BF16
    } else {
        Q8_GEMV_MAX_ROWS
    }
}

/// What the CPU kernels read from a [`WeightView`]: rows widened to f32 and dot products with a row.
pub trait WeightRows {
    /// Row `r` (row length `k`) widened to f32 (an embedding lookup).
    fn row_f32(&self, r: usize, k: usize, out: &mut [f32]);
    /// Dot of `x` with weight row `r` (row length `k`).
    fn dot_row(&self, x: &[f32], r: usize, k: usize) -> f32;
    /// Rows `[r0, r1)` as f32: borrowed when already f32, else widened into `scratch`.
    fn rows_f32<'s>(&'s self, r0: usize, r1: usize, k: usize, scratch: &'s mut Vec<f32>) -> &'s [f32];
}

impl WeightRows for WeightView<'_> {
    /// Row `r` (row length `k`) widened to f32 (an embedding lookup).
    fn row_f32(&self, r: usize, k: usize, out: &mut [f32]) {
        match self {
            WeightView::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            WeightView::Bf16(w) => {
                for (o, &b) in out.iter_mut().zip(&w[r * k..(r + 1) * k]) {
                    *o = half::bf16::from_bits(b).to_f32();
                }
            }
            WeightView::F16(w) => {
                for (o, &b) in out.iter_mut().zip(&w[r * k..(r + 1) * k]) {
                    *o = half::f16::from_bits(b).to_f32();
                }
            }
            WeightView::Nvfp4 { packed, scales, global } => {
                let (pk, sk) = (k / 2, k / nvfp4::BLOCK);
                nvfp4::dequant_row(&packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk], *global, out);
            }
        }
    }

    /// Dot of `x` with weight row `r` (row length `k`).
    #[inline]
    fn dot_row(&self, x: &[f32], r: usize, k: usize) -> f32 {
        match self {
            WeightView::F32(w) => simd::dot_f32(x, &w[r * k..(r + 1) * k]),
            WeightView::Bf16(w) => simd::dot_bf16(x, &w[r * k..(r + 1) * k]),
            WeightView::F16(w) => simd::dot_f16(x, &w[r * k..(r + 1) * k]),
            WeightView::Nvfp4 { packed, scales, global } => {
                let (pk, sk) = (k / 2, k / nvfp4::BLOCK);
                nvfp4::dot(x, &packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk], *global)
            }
        }
    }

    /// Rows `[r0, r1)` as f32: borrowed when already f32, else widened into `scratch`.
    fn rows_f32<'s>(&'s self, r0: usize, r1: usize, k: usize, scratch: &'s mut Vec<f32>) -> &'s [f32] {
        let (a, b) = (r0 * k, r1 * k);
        match self {
            WeightView::F32(w) => &w[a..b],
            WeightView::Bf16(w) => {
                scratch.resize(b - a, 0.0);
                simd::bf16_row_to_f32(&w[a..b], scratch);
                scratch
            }
            WeightView::F16(w) => {
                scratch.resize(b - a, 0.0);
                simd::f16_row_to_f32(&w[a..b], scratch);
                scratch
            }
            WeightView::Nvfp4 { packed, scales, global } => {
                scratch.resize(b - a, 0.0);
                let (pk, sk) = (k / 2, k / nvfp4::BLOCK);
                for (i, r) in (r0..r1).enumerate() {
                    let out = &mut scratch[i * k..(i + 1) * k];
                    nvfp4::dequant_row(&packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk], *global, out);
                }
                scratch
            }
        }
    }
}

/// `out[m, n] = x[m, k] · W[n, k]ᵀ` with f32 activations; `out` is overwritten.
///
/// Panics (a bug, not user input) when the slice lengths disagree with `m`, `n`, `k`.
pub fn matmul(x: &[f32], m: usize, w: WeightView<'_>, n: usize, k: usize, out: &mut [f32]) {
    matmul_with(x, m, w, n, k, out, Precision::Exact)
}

/// [`matmul`] at a [`Precision`].
pub fn matmul_with(x: &[f32], m: usize, w: WeightView<'_>, n: usize, k: usize, out: &mut [f32], p: Precision) {
    assert!(x.len() == m * k && w.len() == n * k && out.len() == m * n, "matmul shapes: this is a bug");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    if !on_gemv_path(m, w, k, p) {
        return run_gemm(gemm_kind(m, w, k, p), x, m, w, n, k, out);
    }
    let acts = RowActs::new(x, m, k, w, p);
    gemv(m, n, out, |r0, block| acts.block(x, k, w, r0, block));
}

/// NVFP4 weights whose rows the int8 path can take at [`Precision::Int8`].
fn int8_eligible(w: WeightView<'_>, k: usize) -> bool {
    matches!(w, WeightView::Nvfp4 { .. }) && k.is_multiple_of(q8::CHUNK)
}

/// Rows from which a matmul takes AMX tiles: one whole tile of activation rows (fewer would leave the
/// tile mostly padding; the AVX-512 GEMMs take them). Sapphire Rapids (docs/benchmarks.md, "AMX at its
/// strength"): at 16 rows AMX-BF16 ran 2.7× the AVX512-BF16 tiles on bf16 weights and even with the VNNI
/// GEMM on NVFP4; at 1 row 0.47×; rows between not measured.
pub const AMX_MIN_ROWS: usize = 16;

/// The fastest GEMM this CPU has (under the [`crate::set_gemm_ceiling`]) for `m` rows against `w` at
/// `p`: at the fast precision, AMX-BF16 tiles where granted (bf16 weights, NVFP4 decoded to bf16) from
/// [`AMX_MIN_ROWS`] rows, then for NVFP4 the AMX-INT8 tiles; else NVFP4 takes the int8 GEMM (AVX-512
/// VNNI: 2× the bf16 tiles' multiply-adds per instruction; AVX2: 2× sgemm on Zen 3), else bf16 tiles
/// where AVX512-BF16 is, else sgemm. The calibration may prefer a lower one per weight class and band of
/// rows ([`Rows`]).
fn gemm_kind(m: usize, w: WeightView<'_>, k: usize, p: Precision) -> Gemm {
    let fast_nvfp4 = p == Precision::Int8 && matches!(w, WeightView::Nvfp4 { .. });
    // NVFP4 rows the int8 GEMMs (AMX-INT8 tiles, VNNI / AVX2) take: whole blocks.
    let int8_nvfp4 = fast_nvfp4 && k.is_multiple_of(nvfp4::BLOCK);
    let amx_weights = fast_nvfp4 || (p == Precision::Int8 && matches!(w, WeightView::Bf16(_)));
    let (class, rows) = (class_of(w), Rows::of(m));
    let amx = amx_weights && m >= AMX_MIN_ROWS && amx::available();
    if amx && allowed_for(class, rows, Gemm::Amx) {
        Gemm::Amx
    } else if amx && int8_nvfp4 && allowed_for(class, rows, Gemm::AmxInt8) {
        Gemm::AmxInt8
    } else if int8_nvfp4 && q8_gemm::available() && allowed_for(class, rows, Gemm::Int8) {
        Gemm::Int8
    } else if bf16_tiles(w, p, rows) {
        Gemm::Bf16
    } else {
        Gemm::F32
    }
}

/// The NVFP4 × int8 GEMM of `kind` for `m` rows (AMX-INT8 tiles, or the int8 GEMM: on [`q8_gemv`] below
/// [`INT8_GEMV_BELOW_ROWS`] where the CPU has it, with the same bits): all take the same quantised rows.
type Int8Gemm = fn(&q8_gemm::Q8Rows, (&[u8], &[u8], f32), usize, &mut [f32]);
fn int8_gemm(kind: Gemm, m: usize) -> Int8Gemm {
    if kind == Gemm::AmxInt8 {
        amx::int8::gemm
    } else if m < INT8_GEMV_BELOW_ROWS && q8_gemv::available() {
        q8_gemv::gemv
    } else {
        q8_gemm::gemm
    }
}

/// Whether a GEMM of `rows` against `w` may run on bf16 tiles ([`bf16`]): the fast precision on a CPU with
/// AVX512-BF16, for bf16 weights and NVFP4 weights (decoded exactly into bf16). The GEMM pads any width
/// to whole 32-value steps.
fn bf16_tiles(w: WeightView<'_>, p: Precision, rows: Rows) -> bool {
    p == Precision::Int8
        && allowed_for(class_of(w), rows, Gemm::Bf16)
        && matches!(w, WeightView::Bf16(_) | WeightView::Nvfp4 { .. })
        && bf16::available()
}

/// Whether the GEMV path (decode) takes bf16 weights on bf16 tiles (rows as stored: the caller checks
/// the width is whole 32-value steps): the fast precision on a CPU with AVX512-BF16 under the ceiling
/// (`--gemm`), whatever the calibration chose for prefill. The
/// calibration times prefill shapes only; when it chose sgemm for bf16 prefill (a near tie at its
/// shapes on a Sapphire Rapids without AMX), decode fell to the f32 dot without prefetch: 24.3 tok/s
/// against 37.9 on the tiles (q35moe-L4 bf16, 2026-12-07, docs/benchmarks.md).
fn bf16_gemv(p: Precision) -> bool {
    p == Precision::Int8 && allowed(Gemm::Bf16) && bf16::available()
}

/// The weight class the dispatch chooses a GEMM for (any dense weights count as bf16).
fn class_of(w: WeightView<'_>) -> WeightClass {
    if matches!(w, WeightView::Nvfp4 { .. }) {
        WeightClass::Nvfp4
    } else {
        WeightClass::Bf16
    }
}

/// The prefill GEMM of `kind` on `x` (`m`×`k`) against `w` (the dispatch's choice, or a candidate the
/// calibration times): NVFP4 on AMX-INT8 tiles or the int8 GEMM takes int8-quantised rows; the rest take f32.
pub(crate) fn run_gemm(kind: Gemm, x: &[f32], m: usize, w: WeightView<'_>, n: usize, k: usize, out: &mut [f32]) {
    match (w, kind) {
        (WeightView::Nvfp4 { packed, scales, global }, kind @ (Gemm::AmxInt8 | Gemm::Int8)) => {
            int8_gemm(kind, m)(&q8_gemm::quantize_rows(x, m, k), (packed, scales, global), n, out)
        }
        (_, Gemm::Amx) => amx::bf16::gemm(x, m, w, n, k, out),
        (_, Gemm::Bf16) => gemm_bf16(x, m, &mut [(w, out)], n, k),
        _ => gemm(x, m, w, n, k, out),
    }
}

/// Whether `m` rows against `w` take the per-row dot path (else the GEMM): up to [`q8_gemv_max_rows`]
/// for NVFP4 rows with int8 activations, up to [`GEMV_MAX_ROWS`] otherwise.
fn on_gemv_path(m: usize, w: WeightView<'_>, k: usize, p: Precision) -> bool {
    if p == Precision::Int8 && int8_eligible(w, k) {
        return m <= q8_gemv_max_rows();
    }
    m <= GEMV_MAX_ROWS
}

/// The activation rows of a GEMV as the dots take them: quantised once to int8 (NVFP4 weights at
/// [`Precision::Int8`]), rounded once to bf16 (bf16 weights at [`Precision::Int8`] on bf16 tiles), or
/// the f32 rows themselves.
enum RowActs {
    Q8(Vec<Q8Act>, Isa),
    Bf16(Vec<u16>),
    F32,
}

impl RowActs {
    fn new(x: &[f32], m: usize, k: usize, w: WeightView<'_>, p: Precision) -> Self {
        if p == Precision::Int8 && int8_eligible(w, k) {
            RowActs::Q8((0..m).map(|i| q8::quantize(&x[i * k..(i + 1) * k])).collect(), Isa::detected())
        } else if matches!(w, WeightView::Bf16(_)) && bf16_gemv(p) && k.is_multiple_of(bf16::STEP) {
            let mut xb = vec![0u16; m * k];
            bf16::round_row(x, &mut xb);
            RowActs::Bf16(xb)
        } else {
            RowActs::F32
        }
    }

    /// Input row `i` · weight row `r`.
    #[inline]
    fn dot(&self, x: &[f32], k: usize, w: WeightView<'_>, i: usize, r: usize) -> f32 {
        match (self, w) {
            (RowActs::Q8(acts, isa), WeightView::Nvfp4 { packed, scales, global }) => {
                let (pk, sk) = (k / 2, k / nvfp4::BLOCK);
                q8::dot(*isa, &acts[i], &packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk], global)
            }
            _ => w.dot_row(&x[i * k..(i + 1) * k], r, k),
        }
    }

    /// Weight rows `r0..` (as many as `block` holds): `block[(r - r0)·m + i]` = input row `i` · row `r`.
    fn block(&self, x: &[f32], k: usize, w: WeightView<'_>, r0: usize, block: &mut [f32]) {
        let m = x.len() / k;
        let rows = block.len() / m;
        if let (RowActs::Bf16(xb), WeightView::Bf16(wb)) = (self, w) {
            let w = bf16::Rows { data: &wb[r0 * k..(r0 + rows) * k], rows };
            return bf16::gemm_nt(bf16::Rows { data: xb, rows: m }, w, k, 1.0, block, (1, m));
        }
        for (j, outs) in block.chunks_mut(m).enumerate() {
            for (i, o) in outs.iter_mut().enumerate() {
                *o = self.dot(x, k, w, i, r0 + j);
            }
        }
    }
}

/// `out1 = x·W1ᵀ`, `out2 = x·W2ᵀ` for two weights of one shape (an MLP's gate and up) in one pass: on
/// the per-row dot path the activations are quantised once and both weights' rows are split across the
/// pool together (one dispatch instead of two); on bf16 tiles the activations are rounded once and both
/// weights' blocks share one dispatch; otherwise two GEMMs.
#[allow(clippy::too_many_arguments)]
pub fn matmul_pair_with(
    x: &[f32],
    m: usize,
    (w1, w2): (WeightView<'_>, WeightView<'_>),
    n: usize,
    k: usize,
    (out1, out2): (&mut [f32], &mut [f32]),
    p: Precision,
) {
    let same_kind = std::mem::discriminant(&w1) == std::mem::discriminant(&w2);
    if let (
        WeightView::Nvfp4 { packed: p1, scales: s1, global: g1 },
        WeightView::Nvfp4 { packed: p2, scales: s2, global: g2 },
    ) = (w1, w2)
    {
        let kind = gemm_kind(m, w1, k, p);
        if m > 0 && n > 0 && !on_gemv_path(m, w1, k, p) && matches!(kind, Gemm::Int8 | Gemm::AmxInt8) {
            assert!(x.len() == m * k && w1.len() == n * k && w2.len() == n * k, "matmul shapes: this is a bug");
            // Both GEMMs take the same int8 rows: quantised once.
            let a = q8_gemm::quantize_rows(x, m, k);
            let run = int8_gemm(kind, m);
            run(&a, (p1, s1, g1), n, out1);
            return run(&a, (p2, s2, g2), n, out2);
        }
    }
    // Two weights of one kind take the same GEMM (the kind, rows and width decide it).
    if m > 0 && n > 0 && k > 0 && same_kind && !on_gemv_path(m, w1, k, p) && gemm_kind(m, w1, k, p) == Gemm::Bf16 {
        assert!(x.len() == m * k && w1.len() == n * k && w2.len() == n * k, "matmul shapes: this is a bug");
        assert!(out1.len() == m * n && out2.len() == m * n, "matmul shapes: this is a bug");
        // Both GEMMs take the same bf16 rows, rounded once, and share one dispatch.
        return gemm_bf16(x, m, &mut [(w1, out1), (w2, out2)], n, k);
    }
    if m == 0 || n == 0 || k == 0 || !same_kind || !on_gemv_path(m, w1, k, p) || !on_gemv_path(m, w2, k, p) {
        matmul_with(x, m, w1, n, k, out1, p);
        return matmul_with(x, m, w2, n, k, out2, p);
    }
    assert!(x.len() == m * k && w1.len() == n * k && w2.len() == n * k, "matmul shapes: this is a bug");
    assert!(out1.len() == m * n && out2.len() == m * n, "matmul shapes: this is a bug");
    let acts = RowActs::new(x, m, k, w1, p);
    let mut both = vec![0f32; m * 2 * n];
    gemv(m, 2 * n, &mut both, |r0, block| {
        // A block may straddle the two weights: split it where W2 begins.
        let split = (n.saturating_sub(r0) * m).min(block.len());
        let (first, second) = block.split_at_mut(split);
        if !first.is_empty() {
            acts.block(x, k, w1, r0, first);
        }
        if !second.is_empty() {
            acts.block(x, k, w2, (r0 + split / m) - n, second);
        }
    });
    for i in 0..m {
        out1[i * n..(i + 1) * n].copy_from_slice(&both[i * 2 * n..i * 2 * n + n]);
        out2[i * n..(i + 1) * n].copy_from_slice(&both[i * 2 * n + n..(i + 1) * 2 * n]);
    }
}

/// Weight rows per GEMV task.
const GEMV_BLOCK: usize = 64;

/// Few rows: `block(r0, b)` fills `b[(r - r0)·m + i]` for a block of weight rows starting at `r0`; the
/// blocks are split across the pool and each weight row is read once for all `m` input rows.
fn gemv(m: usize, n: usize, out: &mut [f32], block: impl Fn(usize, &mut [f32]) + Sync) {
    if m == 1 {
        pool::chunks_mut(out, GEMV_BLOCK, |c, b| block(c * GEMV_BLOCK, b));
        return;
    }
    let mut tmp = vec![0f32; n * m];
    pool::chunks_mut(&mut tmp, GEMV_BLOCK * m, |c, b| block(c * GEMV_BLOCK, b));
    for r in 0..n {
        for i in 0..m {
            out[i * n + r] = tmp[r * m + i];
        }
    }
}

/// Many rows on bf16 tiles, against one or more weights of one shape (an MLP's gate and up): the
/// activations are rounded to bf16 once, each task takes a block of one weight's rows (bf16 borrowed as
/// stored; NVFP4 decoded into a bf16 scratch tile without its global scale, which is exact, the global
/// then scaling the sums) and writes its columns of that weight's output in place.
fn gemm_bf16(x: &[f32], m: usize, ws: &mut [(WeightView<'_>, &mut [f32])], n: usize, k: usize) {
    // Weight rows per task: a whole number of the tiles' 3 rows (64 left a one-row tile in every block).
    const NB: usize = 66;
    // A width that is not a whole number of 32-value steps (a vision MLP's 4304) is zero-padded: the
    // activations once here, the weight rows per task (bf16 rows are then copied, not borrowed).
    let kp = k.next_multiple_of(bf16::STEP);
    let mut xb = vec![0u16; m * kp];
    pool::chunks_mut(&mut xb, kp * 16, |c, d| {
        for (i, row) in d.chunks_mut(kp).enumerate() {
            let r = c * 16 + i;
            bf16::round_row(&x[r * k..(r + 1) * k], &mut row[..k]);
        }
    });
    let outs: Vec<(WeightView<'_>, OutPtr)> = ws.iter_mut().map(|(w, o)| (*w, OutPtr(o.as_mut_ptr()))).collect();
    let blocks = n.div_ceil(NB);
    pool::for_each_init(
        blocks * outs.len(),
        || (Vec::new(), Vec::new()),
        |(wide, narrow), task| {
            let (w, out) = outs[task / blocks];
            let (r0, r1) = (task % blocks * NB, ((task % blocks + 1) * NB).min(n));
            let (rows, scale) = bf16_block(w, (r0, r1), k, kp, wide, narrow);
            let w = bf16::Rows { data: rows, rows: r1 - r0 };
            // SAFETY: this task alone writes out[i, r0..r1] for every row i (blocks are disjoint), in bounds.
            unsafe { bf16::gemm_nt_raw(bf16::Rows { data: &xb, rows: m }, w, kp, scale, out.0.add(r0), (n, 1)) };
        },
    );
}

/// Weight rows `r0..r1` as bf16 rows of `kp` values and the scale of their sums: bf16 rows borrowed as
/// stored where `kp == k`, else copied zero-padded into `narrow`; NVFP4 rows decoded into it.
fn bf16_block<'a>(
    w: WeightView<'a>,
    (r0, r1): (usize, usize),
    k: usize,
    kp: usize,
    wide: &mut Vec<f32>,
    narrow: &'a mut Vec<u16>,
) -> (&'a [u16], f32) {
    if let WeightView::Bf16(wb) = w {
        if kp == k {
            return (&wb[r0 * k..r1 * k], 1.0);
        }
    }
    narrow.clear();
    narrow.resize((r1 - r0) * kp, 0);
    match w {
        WeightView::Bf16(wb) => {
            for (i, row) in narrow.chunks_mut(kp).enumerate() {
                row[..k].copy_from_slice(&wb[(r0 + i) * k..(r0 + i + 1) * k]);
            }
            (&narrow[..], 1.0)
        }
        WeightView::Nvfp4 { packed, scales, global } => {
            let (pk, sk) = (k / 2, k / nvfp4::BLOCK);
            for (i, row) in narrow.chunks_mut(kp).enumerate() {
                let r = r0 + i;
                let (p, s) = (&packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk]);
                bf16::nvfp4_row(p, s, wide, &mut row[..k]);
            }
            (&narrow[..], global)
        }
        _ => unreachable!("bf16 tiles take bf16 and NVFP4 weights"),
    }
}

fn gemm(x: &[f32], m: usize, w: WeightView<'_>, n: usize, k: usize, out: &mut [f32]) {
    // sgemm packs all of `x` again for every tile, which costs about as much as a small tile's
    // multiply-adds (it was 45% of a 512-token prefill with 256 KiB tiles): so tiles are as large as
    // the pool allows — two per thread — with the widened copy capped at 8 MiB.
    let threads = pool::threads();
    let cap = ((1usize << 21) / k).max(16);
    let nb = (n.div_ceil(2 * threads).clamp(16, cap)).div_ceil(16) * 16;
    let blocks = n.div_ceil(nb);
    let ptr = OutPtr(out.as_mut_ptr());
    pool::for_each_init(blocks, Vec::new, |scratch, b| {
        let r0 = b * nb;
        let r1 = (r0 + nb).min(n);
        let tile = w.rows_f32(r0, r1, k, scratch);
        let p = ptr;
        // SAFETY: C is out[:, r0..r1] (row stride n), disjoint between blocks; A and B are in bounds.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                r1 - r0,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                tile.as_ptr(),
                1,
                k as isize,
                0.0,
                p.0.add(r0),
                n as isize,
                1,
            );
        }
    });
}

/// General strided f32 GEMM, `C = alpha·A·B + beta·C`, for small dense blocks inside kernels.
pub fn matmul_into_strided(
    (m, k, n): (usize, usize, usize),
    a: (&[f32], isize, isize),
    b: (&[f32], isize, isize),
    c: (&mut [f32], isize, isize),
    alpha: f32,
    beta: f32,
) {
    let span = |rows: usize, cols: usize, rs: isize, cs: isize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            ((rows - 1) as isize * rs + (cols - 1) as isize * cs) as usize + 1
        }
    };
    assert!(a.0.len() >= span(m, k, a.1, a.2), "gemm A bounds: this is a bug");
    assert!(b.0.len() >= span(k, n, b.1, b.2), "gemm B bounds: this is a bug");
    assert!(c.0.len() >= span(m, n, c.1, c.2), "gemm C bounds: this is a bug");
    // SAFETY: bounds checked above for non-negative strides (all callers use them).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.0.as_ptr(),
            a.1,
            a.2,
            b.0.as_ptr(),
            b.1,
            b.2,
            beta,
            c.0.as_mut_ptr(),
            c.1,
            c.2,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::allowed;

    fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn int8_nvfp4_takes_the_integer_path_up_to_its_row_limit_and_the_gemm_beyond() {
        let (n, k) = (24, 128);
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
        let view = WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.25 };
        let limit = q8_gemv_max_rows();
        for m in [1usize, 5, limit, limit + 1, Q8_GEMV_MAX_ROWS + 1] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
            let mut got = vec![0f32; m * n];
            matmul_with(&x, m, view, n, k, &mut got, Precision::Int8);
            let mut want = vec![0f32; m * n];
            if m <= limit {
                for i in 0..m {
                    let a = q8::quantize(&x[i * k..(i + 1) * k]);
                    for r in 0..n {
                        let (p, s) = (&packed[r * k / 2..(r + 1) * k / 2], &scales[r * k / 16..(r + 1) * k / 16]);
                        want[i * n + r] = q8::dot(Isa::detected(), &a, p, s, 0.25);
                    }
                }
            } else if m >= AMX_MIN_ROWS && amx::available() && allowed(Gemm::Amx) {
                // Beyond the limit, from a whole tile of rows, AMX-BF16 tiles where granted (their values:
                // amx::bf16's tests).
                amx::bf16::gemm(&x, m, view, n, k, &mut want);
            } else if m >= AMX_MIN_ROWS && amx::available() && allowed(Gemm::AmxInt8) {
                // Under the amx-int8 ceiling, AMX-INT8 tiles (their values: amx::int8's tests; they sum
                // in another order than the AVX-512 GEMM).
                amx::int8::gemm(&q8_gemm::quantize_rows(&x, m, k), (&packed, &scales, 0.25), n, &mut want);
            } else if q8_gemm::available() && allowed(Gemm::Int8) {
                // Beyond the limit, the int8 GEMM (its values: q8_gemm's tests).
                q8_gemm::gemm(&q8_gemm::quantize_rows(&x, m, k), (&packed, &scales, 0.25), n, &mut want);
            } else if bf16::available() && allowed(Gemm::Bf16) {
                // Beyond the limit, the GEMM on bf16 tiles (its values: the test below).
                assert!(got.iter().all(|v| v.is_finite()), "m={m}");
                continue;
            } else {
                matmul_with(&x, m, view, n, k, &mut want, Precision::Exact);
            }
            assert_eq!(got, want, "m={m}");
        }
    }

    /// At the fast precision on a CPU with AVX512-BF16, bf16 weights (GEMV and GEMM) and NVFP4 weights
    /// beyond the int8 row limit compute with activations rounded to bf16: equal to an f64 sum over the
    /// rounded activations and the exact weights, up to f32 summation. Mutation-checked: rounding the
    /// activations toward zero instead of to nearest breaks it.
    #[test]
    fn fast_matmuls_on_bf16_tiles_equal_bf16_rounded_activations_times_exact_weights() {
        if !(bf16::available() && allowed(Gemm::Bf16)) {
            eprintln!("no AVX512-BF16 here (or OSPREY_GEMM=f32): f32 activations outside the int8 path");
            return;
        }
        let (n, k) = (70, 128);
        let wf: Vec<f32> = (0..n * k).map(|i| ((i * 104729 % 89) as f32 / 89.0) - 0.5).collect();
        let wb: Vec<u16> = wf.iter().map(|&v| bf16::round(v)).collect();
        let wb_f: Vec<f32> = wb.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
        let mut nv_f = vec![0f32; n * k];
        for r in 0..n {
            let (p, s) = (&packed[r * k / 2..(r + 1) * k / 2], &scales[r * k / 16..(r + 1) * k / 16]);
            nvfp4::dequant_row(p, s, 0.25, &mut nv_f[r * k..(r + 1) * k]);
        }
        let nv = WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.25 };
        let mut cases = vec![(WeightView::Bf16(&wb), &wb_f, vec![1usize, 3, 5, 40])];
        if !(q8_gemm::available() && allowed(Gemm::Int8)) {
            // With AVX-512 VNNI (allowed), NVFP4 beyond the limit takes the int8 GEMM instead.
            cases.push((nv, &nv_f, vec![q8_gemv_max_rows() + 1, 70]));
        }
        for (view, dense, rows) in cases {
            for m in rows {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.3) - 0.5).collect();
                let xr: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
                let want = reference(&xr, m, dense, n, k);
                let exact = reference(&x, m, dense, n, k);
                let mut got = vec![0f32; m * n];
                matmul_with(&x, m, view, n, k, &mut got, Precision::Int8);
                // 128 exact products of magnitude <= 0.25 (x 0.25 for NVFP4's global), summed in f32.
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-5, "m={m}: {g} vs {w}");
                }
                assert!(got.iter().zip(&exact).any(|(g, e)| (g - e).abs() > 1e-5), "m={m}: took the f32 path");
            }
        }
    }

    /// A width that is not a whole number of 32-value steps (a vision MLP's 4304 = 134.5 steps) still
    /// takes the bf16 tiles in the GEMM, zero-padded: equal to bf16-rounded activations times the weights.
    /// Mutation-checked: padding both operands with ones breaks it.
    #[test]
    fn bf16_gemm_pads_widths_that_are_not_whole_steps() {
        if !(bf16::available() && allowed(Gemm::Bf16)) {
            eprintln!("no AVX512-BF16 here (or OSPREY_GEMM=f32): f32 activations outside the int8 path");
            return;
        }
        let (m, n, k) = (40, 70, 100);
        let wb: Vec<u16> = (0..n * k).map(|i| bf16::round(((i * 104729 % 89) as f32 / 89.0) - 0.5)).collect();
        let wf: Vec<f32> = wb.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.3) - 0.5).collect();
        let xr: Vec<f32> = x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        let want = reference(&xr, m, &wf, n, k);
        let mut got = vec![0f32; m * n];
        matmul_with(&x, m, WeightView::Bf16(&wb), n, k, &mut got, Precision::Int8);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        assert!(got.iter().zip(&reference(&x, m, &wf, n, k)).any(|(g, e)| (g - e).abs() > 1e-5), "took the f32 path");
    }

    #[test]
    fn a_fused_pair_equals_two_matmuls_at_every_precision() {
        // 140 rows: on bf16 tiles, each weight in three tasks' blocks, the last one short.
        let (n, k) = (140, 128);
        let packed: Vec<Vec<u8>> =
            (0..2).map(|s| (0..n * k / 2).map(|i| ((i * 131 + s * 7) % 256) as u8).collect()).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
        let bf: Vec<Vec<u16>> = (0..2)
            .map(|s| {
                (0..n * k).map(|i| half::bf16::from_f32(((i * 7 + s) % 13) as f32 / 13.0 - 0.5).to_bits()).collect()
            })
            .collect();
        let nv = |s: usize| WeightView::Nvfp4 { packed: &packed[s], scales: &scales, global: 0.5 };
        for (w1, w2) in [(nv(0), nv(1)), (WeightView::Bf16(&bf[0]), WeightView::Bf16(&bf[1]))] {
            for m in [1usize, 3, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
                for p in [Precision::Exact, Precision::Int8] {
                    let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
                    let (mut a2, mut b2) = (vec![0f32; m * n], vec![0f32; m * n]);
                    matmul_pair_with(&x, m, (w1, w2), n, k, (&mut a, &mut b), p);
                    matmul_with(&x, m, w1, n, k, &mut a2, p);
                    matmul_with(&x, m, w2, n, k, &mut b2, p);
                    assert_eq!((a, b), (a2, b2), "m={m} {p:?}");
                }
            }
        }
    }

    #[test]
    fn nvfp4_gemv_and_gemm_equal_dequantise_then_f32_matmul() {
        let (n, k) = (40, 64);
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
        let view = WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.25 };
        let mut dense = vec![0f32; n * k];
        for r in 0..n {
            nvfp4::dequant_row(
                &packed[r * k / 2..(r + 1) * k / 2],
                &scales[r * k / 16..(r + 1) * k / 16],
                0.25,
                &mut dense[r * k..(r + 1) * k],
            );
        }
        for m in [1usize, 3, 9] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
            let want = reference(&x, m, &dense, n, k);
            let mut got = vec![0f32; m * n];
            matmul(&x, m, view, n, k, &mut got);
            // Same products, other summation orders (block partial sums × scale): f32 rounding only.
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < 1e-4 * w.abs().max(1.0), "m={m}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn all_paths_and_dtypes_match_f64_reference() {
        for &(m, n, k) in &[(1, 70, 33), (3, 130, 64), (4, 5, 7), (5, 17, 9), (37, 300, 128), (9, 1, 3)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
            let wf: Vec<f32> = (0..n * k).map(|i| ((i * 104729 % 89) as f32 / 89.0) - 0.5).collect();
            let wb: Vec<u16> = wf.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let wh: Vec<u16> = wf.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            let wb_f: Vec<f32> = wb.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
            let wh_f: Vec<f32> = wh.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect();
            for (view, wref) in
                [(WeightView::F32(&wf), &wf), (WeightView::Bf16(&wb), &wb_f), (WeightView::F16(&wh), &wh_f)]
            {
                let want = reference(&x, m, wref, n, k);
                let mut got = vec![f32::NAN; m * n];
                matmul(&x, m, view, n, k, &mut got);
                // f32 accumulation over k <= 128 terms of magnitude <= 0.25: error well below 1e-5.
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() < 1e-5, "m={m} n={n} k={k}: {g} vs {w}");
                }
            }
        }
    }
}
