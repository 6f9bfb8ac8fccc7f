//! The tile instructions in software, for machines without AMX (this one): eight 1 KiB tiles and a
//! configuration per thread, and `tilezero`, `tileloadd`, `tilestored`, `tdpbf16ps` and `tdpbusd` as
//! Intel's instruction reference defines them (palette 1). With [`super::init_emulated`] the tile kernels
//! run every blocking, packing, padding and indexing decision of theirs through it, so their odd shapes
//! are proven on any CPU; what stays unproven without an AMX machine is the hardware itself (the
//! instruction encodings are checked with objdump, docs/benchmarks.md).

use std::cell::RefCell;

use super::TileConfig;

/// A thread's tile state: per tile its (rows, bytes per row) and its 16 × 64 bytes.
struct Tiles {
    shape: [(usize, usize); 8],
    data: [[u8; 1024]; 8],
}

thread_local! {
    static TILES: RefCell<Tiles> = const { RefCell::new(Tiles { shape: [(0, 0); 8], data: [[0; 1024]; 8] }) };
}

/// `ldtilecfg`: every tile takes its shape and is zeroed.
pub(crate) fn configure(cfg: &TileConfig) {
    TILES.with(|t| {
        let mut t = t.borrow_mut();
        for i in 0..8 {
            let colsb = usize::from(cfg.0[16 + 2 * i]) | (usize::from(cfg.0[16 + 2 * i + 1]) << 8);
            t.shape[i] = (usize::from(cfg.0[48 + i]), colsb);
            t.data[i] = [0; 1024];
        }
    });
}

fn shape(t: &Tiles, tile: usize) -> (usize, usize) {
    let s = t.shape[tile];
    assert!(s.0 > 0 && s.0 <= 16 && s.1 > 0 && s.1 <= 64, "tile {tile} used unconfigured ({s:?}): a bug");
    s
}

/// `tilezero`.
pub(crate) fn zero(tile: usize) {
    TILES.with(|t| t.borrow_mut().data[tile] = [0; 1024]);
}

/// `tileloadd`: `rows` rows of `colsb` bytes, row `r` at `p + r·stride`; the rest of the tile zeroed.
///
/// # Safety
/// Every row read must be valid memory.
pub(crate) unsafe fn load(tile: usize, p: *const u8, stride: usize) {
    TILES.with(|t| {
        let mut t = t.borrow_mut();
        let (rows, colsb) = shape(&t, tile);
        let mut data = [0u8; 1024];
        for r in 0..rows {
            // SAFETY: the caller guarantees the row is readable.
            let src = unsafe { std::slice::from_raw_parts(p.add(r * stride), colsb) };
            data[r * 64..r * 64 + colsb].copy_from_slice(src);
        }
        t.data[tile] = data;
    });
}

/// `tilestored`: `rows` rows of `colsb` bytes to `p + r·stride`.
///
/// # Safety
/// Every row written must be valid memory.
pub(crate) unsafe fn store(tile: usize, p: *mut u8, stride: usize) {
    TILES.with(|t| {
        let t = t.borrow();
        let (rows, colsb) = shape(&t, tile);
        for r in 0..rows {
            // SAFETY: the caller guarantees the row is writable.
            unsafe { std::ptr::copy_nonoverlapping(t.data[tile][r * 64..].as_ptr(), p.add(r * stride), colsb) };
        }
    });
}

fn word(row: &[u8], i: usize) -> [u8; 4] {
    [row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]
}

/// A bf16 as f32, subnormals flushed to zero (the instruction's DAZ).
fn bf16(lo: u8, hi: u8) -> f32 {
    let v = f32::from_bits((u32::from(hi) << 24) | (u32::from(lo) << 16));
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// How an element type reads from and writes to a tile's 4 bytes.
type Codec<V> = (fn([u8; 4]) -> V, fn(V) -> [u8; 4]);

/// `C[m][n] = step(C[m][n], A[m] word k, B[k] word n)` for every `k < a.colsb / 4` in order, over C's
/// rows and its `colsb / 4` columns of 4-byte elements (`V` read and written little-endian).
fn accumulate<V: Copy>(
    (c, a, b): (usize, usize, usize),
    (from, to): Codec<V>,
    step: impl Fn(V, [u8; 4], [u8; 4]) -> V,
) {
    TILES.with(|t| {
        let mut t = t.borrow_mut();
        let ((m_rows, c_colsb), (_, a_colsb)) = (shape(&t, c), shape(&t, a));
        let mut out = t.data[c];
        for m in 0..m_rows {
            for n in 0..c_colsb / 4 {
                let mut acc = from(word(&out[m * 64..], n));
                for k in 0..a_colsb / 4 {
                    acc = step(acc, word(&t.data[a][m * 64..], k), word(&t.data[b][k * 64..], n));
                }
                out[m * 64 + 4 * n..m * 64 + 4 * n + 4].copy_from_slice(&to(acc));
            }
        }
        t.data[c] = out;
    });
}

/// `tdpbf16ps c, a, b`: `C[m][n] += A[m][2k]·B[k][2n] + A[m][2k+1]·B[k][2n+1]` over `k < a.colsb / 4`,
/// in that order, in f32 (each bf16 product is exact in f32; results flushed to zero when subnormal).
pub(crate) fn dpbf16ps(c: usize, a: usize, b: usize) {
    let flush = |v: f32| if v.is_subnormal() { 0.0f32.copysign(v) } else { v };
    accumulate((c, a, b), (f32::from_le_bytes, f32::to_le_bytes), |acc, x, w| {
        let acc = acc + bf16(x[0], x[1]) * bf16(w[0], w[1]);
        flush(acc + bf16(x[2], x[3]) * bf16(w[2], w[3]))
    });
}

/// `tdpbusd c, a, b`: `C[m][n] += Σ_i u8(A[m][4k+i]) · s8(B[k][4n+i])` over `k < a.colsb / 4`, i32
/// wrapping.
pub(crate) fn dpbusd(c: usize, a: usize, b: usize) {
    accumulate((c, a, b), (i32::from_le_bytes, i32::to_le_bytes), |acc, x, w| {
        (0..4).fold(acc, |acc, i| acc.wrapping_add(i32::from(x[i]) * i32::from(w[i] as i8)))
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One instruction of each kind on small hand-checked values, through loads and stores with strides.
    #[test]
    fn the_instructions_compute_what_the_reference_defines() {
        static CFG: TileConfig = TileConfig::new(&[(2, 8), (2, 8), (2, 8)]);
        configure(&CFG);
        // bf16: A = [[1, 2, 3, 4], [0.5, 0, 0, 0]] (two pairs per row), B = rows k of pairs for n = 0, 1.
        let bf = |v: f32| (v.to_bits() >> 16) as u16;
        let a: Vec<u16> = [1.0, 2.0, 3.0, 4.0, 0.5, 0.0, 0.0, 0.0].map(bf).to_vec();
        let b: Vec<u16> = [1.0, 10.0, 100.0, 1000.0, 2.0, 20.0, 200.0, 2000.0].map(bf).to_vec();
        let mut c = [7.0f32; 4];
        // SAFETY: the buffers hold the 2 rows × 8 bytes each access reads or writes.
        unsafe {
            load(0, c.as_ptr().cast(), 8);
            load(1, a.as_ptr().cast(), 8);
            load(2, b.as_ptr().cast(), 8);
            dpbf16ps(0, 1, 2);
            store(0, c.as_mut_ptr().cast(), 8);
        }
        // C[0][0] = 7 + 1·1 + 2·10 + 3·2 + 4·20; C[0][1] = 7 + 100 + 2000 + 600 + 8000; row 1: 7 + 0.5, 7 + 50.
        assert_eq!(c, [114.0, 10707.0, 7.5, 57.0]);
        // busd: u8 × s8, four per word.
        let a: [u8; 16] = [1, 2, 3, 4, 255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let b: [i8; 16] = [1, 1, 1, 1, -1, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0];
        let mut c = [0i32; 4];
        zero(0);
        // SAFETY: as above.
        unsafe {
            load(1, a.as_ptr(), 8);
            load(2, b.as_ptr().cast(), 8);
            dpbusd(0, 1, 2);
            store(0, c.as_mut_ptr().cast(), 8);
        }
        // C[0][0] = (1+2+3+4)·1 + 255·2 = 520 (k = 0 word 0 of B row 0, k = 1: A's second word × B row 1);
        // C[0][1] = 1·(-1) + 255·0 = -1.
        assert_eq!(c, [10 + 255 * 2, -1, 0, 0]);
    }
}
