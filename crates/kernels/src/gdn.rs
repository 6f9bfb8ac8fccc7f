//! Gated DeltaNet: the causal depthwise conv with carried state, and the gated delta rule.
//!
//! Per value head `h` (key head `h / (nv/nk)`, i.e. `repeat_interleave`), with q, k L2-normalised and q
//! scaled by `dk^-½` by the caller, and the fp32 state `S [dk, dv]`:
//! `S ← S·exp(g)`, `δ = β(v − Sᵀk)`, `S ← S + k⊗δ`, `o = Sᵀq`.
//! [`gated_delta_recurrent`] runs that token by token (decode). [`gated_delta_chunked`] is the chunked
//! (UT-transform) form transformers' `torch_chunk_gated_delta_rule` uses for prefill, with chunks of
//! [`CHUNK`] tokens counted from the start of the call; both give the same state up to f32 rounding.

pub use osprey_backend::types::GdnShape;

use crate::act::silu;
use crate::matmul::matmul_into_strided as gemm;

/// Chunk length of the chunked form (the FLA / transformers value).
pub const CHUNK: usize = 64;

/// Causal depthwise conv over `n` rows of `c` channels followed by silu, continuing from `state`.
///
/// `x [n, c]` are pre-conv inputs, `w [c, kernel]` the conv weight (last tap = current input), and
/// `state [(kernel-1), c]` the previous `kernel-1` inputs, oldest first (zeros for a new sequence). The
/// state is advanced to the last `kernel-1` inputs.
pub fn causal_conv_silu(x: &[f32], c: usize, w: &[f32], kernel: usize, state: &mut [f32], out: &mut [f32]) {
    let n = x.len() / c;
    let hist = kernel - 1;
    assert!(state.len() == hist * c && w.len() == c * kernel && out.len() == x.len(), "conv shapes: this is a bug");
    // Row r of the padded input: the state for r < hist, else x[r - hist].
    let row = |r: usize| -> &[f32] {
        if r < hist {
            &state[r * c..(r + 1) * c]
        } else {
            &x[(r - hist) * c..(r - hist + 1) * c]
        }
    };
    // Rows are independent (each reads its own window), so a prefill's rows split across the pool in
    // blocks of CONV_ROWS; the same arithmetic per row either way. A 512-token prefill spent ~2% of its
    // time here, the pool's other threads waiting.
    const CONV_ROWS: usize = 16;
    let one = |t: usize, o: &mut [f32]| {
        o.fill(0.0);
        for j in 0..kernel {
            let xr = row(t + j);
            for ch in 0..c {
                o[ch] += w[ch * kernel + j] * xr[ch];
            }
        }
        o.iter_mut().for_each(|v| *v = silu(*v));
    };
    if n <= CONV_ROWS {
        out.chunks_mut(c).enumerate().for_each(|(t, o)| one(t, o));
    } else {
        crate::pool::chunks_mut(out, c * CONV_ROWS, |b, block| {
            block.chunks_mut(c).enumerate().for_each(|(i, o)| one(b * CONV_ROWS + i, o));
        });
    }
    // New state: the last `hist` rows of [state; x].
    let mut next = vec![0f32; hist * c];
    for r in 0..hist {
        next[r * c..(r + 1) * c].copy_from_slice(row(n + r));
    }
    state.copy_from_slice(&next);
}

/// Per-token inputs of the delta rule for one sequence.
#[derive(Clone, Copy, Debug)]
pub struct DeltaInputs<'a> {
    /// `[n, nk, dk]`, L2-normalised and scaled.
    pub q: &'a [f32],
    /// `[n, nk, dk]`, L2-normalised.
    pub k: &'a [f32],
    /// `[n, nv, dv]`.
    pub v: &'a [f32],
    /// `[n, nv]` log decay (≤ 0).
    pub g: &'a [f32],
    /// `[n, nv]` write strength in (0, 1).
    pub beta: &'a [f32],
}

/// Gathers head `h`'s rows into contiguous `[n, d]` buffers.
fn head_rows(src: &[f32], n: usize, heads: usize, d: usize, h: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * d);
    for t in 0..n {
        out.extend_from_slice(&src[(t * heads + h) * d..(t * heads + h + 1) * d]);
    }
    out
}

fn per_head(s: GdnShape, inp: DeltaInputs<'_>, state: &mut [f32], out: &mut [f32], f: impl Fn(HeadIo<'_>) + Sync) {
    let n = inp.g.len() / s.nv;
    assert!(state.len() == s.state_len() && out.len() == n * s.nv * s.dv, "delta rule shapes: this is a bug");
    let rep = s.nv / s.nk;
    let mut heads: Vec<(&mut [f32], Vec<f32>)> = state.chunks_mut(s.dk * s.dv).map(|st| (st, Vec::new())).collect();
    crate::pool::chunks_mut(&mut heads, 1, |h, one| {
        let (st, o) = &mut one[0];
        let kh = h / rep;
        *o = vec![0f32; n * s.dv];
        f(HeadIo {
            q: head_rows(inp.q, n, s.nk, s.dk, kh),
            k: head_rows(inp.k, n, s.nk, s.dk, kh),
            v: head_rows(inp.v, n, s.nv, s.dv, h),
            g: (0..n).map(|t| inp.g[t * s.nv + h]).collect(),
            beta: (0..n).map(|t| inp.beta[t * s.nv + h]).collect(),
            s: &mut st[..],
            out: o,
            dk: s.dk,
            dv: s.dv,
        });
    });
    for (h, (_, o)) in heads.iter().enumerate() {
        for t in 0..n {
            out[(t * s.nv + h) * s.dv..(t * s.nv + h + 1) * s.dv].copy_from_slice(&o[t * s.dv..(t + 1) * s.dv]);
        }
    }
}

struct HeadIo<'a> {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    s: &'a mut [f32],
    out: &'a mut [f32],
    dk: usize,
    dv: usize,
}

/// Token-by-token delta rule; `state [nv, dk, dv]` is advanced, `out [n, nv, dv]` written.
pub fn gated_delta_recurrent(s: GdnShape, inp: DeltaInputs<'_>, state: &mut [f32], out: &mut [f32]) {
    per_head(s, inp, state, out, |io| {
        let (dk, dv) = (io.dk, io.dv);
        let st = io.s;
        let mut delta = vec![0f32; dv];
        for t in 0..io.g.len() {
            let (q, k, v) = (&io.q[t * dk..(t + 1) * dk], &io.k[t * dk..(t + 1) * dk], &io.v[t * dv..(t + 1) * dv]);
            let decay = io.g[t].exp();
            st.iter_mut().for_each(|x| *x *= decay);
            // kv_mem[j] = Σ_i S[i][j]·k[i]
            delta.copy_from_slice(v);
            for i in 0..dk {
                for j in 0..dv {
                    delta[j] -= st[i * dv + j] * k[i];
                }
            }
            delta.iter_mut().for_each(|d| *d *= io.beta[t]);
            let o = &mut io.out[t * dv..(t + 1) * dv];
            o.fill(0.0);
            for i in 0..dk {
                for j in 0..dv {
                    st[i * dv + j] += k[i] * delta[j];
                    o[j] += st[i * dv + j] * q[i];
                }
            }
        }
    });
}

/// Chunked delta rule (prefill); same contract as [`gated_delta_recurrent`].
pub fn gated_delta_chunked(s: GdnShape, inp: DeltaInputs<'_>, state: &mut [f32], out: &mut [f32]) {
    per_head(s, inp, state, out, chunked_head);
}

fn chunked_head(io: HeadIo<'_>) {
    // A fast-forgetting head's decays reach exp(-87) and below inside a chunk, so its decayed keys and
    // queries, and products with them, fall below f32's smallest normal; Intel cores take a microcode
    // assist on every such operand. Measured (Sapphire Rapids, Qwen3.5-35B-A3B shapes, a random-weight
    // checkpoint): 0.22 s per layer for a 512-token chunk with denormals against 0.031 s flushed. The
    // values flushed are below 1.2e-38, and the outputs O(1).
    let _flush = FlushDenormals::new();
    let (dk, dv) = (io.dk, io.dv);
    let n = io.g.len();
    let st = io.s;
    let mut s0 = 0;
    while s0 < n {
        let c = CHUNK.min(n - s0);
        let q = &io.q[s0 * dk..(s0 + c) * dk];
        let k = &io.k[s0 * dk..(s0 + c) * dk];
        let v = &io.v[s0 * dv..(s0 + c) * dv];
        let beta = &io.beta[s0..s0 + c];
        // Cumulative log decay inside the chunk.
        let mut cum = vec![0f32; c];
        let mut acc = 0f32;
        for i in 0..c {
            acc += io.g[s0 + i];
            cum[i] = acc;
        }
        let last = cum[c - 1];
        let decay = |i: usize, j: usize| (cum[i] - cum[j]).exp();
        // kb = k·β, vb = v·β, kd = kb·exp(cum).
        let mut kb = k.to_vec();
        let mut kd = k.to_vec();
        let mut vb = v.to_vec();
        for i in 0..c {
            kb[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= beta[i]);
            let e = cum[i].exp();
            for (d, b) in kd[i * dk..(i + 1) * dk].iter_mut().zip(&kb[i * dk..(i + 1) * dk]) {
                *d = b * e;
            }
            vb[i * dv..(i + 1) * dv].iter_mut().for_each(|x| *x *= beta[i]);
        }
        // L = strictly lower part of (kb·kᵀ)∘decay; the unit-lower system (I + L)·X = rhs is solved by
        // forward substitution for rhs = vb (new values) and rhs = kd (decayed keys).
        let mut kk = vec![0f32; c * c];
        gemm((c, dk, c), (&kb, dk as isize, 1), (k, 1, dk as isize), (&mut kk, c as isize, 1), 1.0, 0.0);
        let mut qk = vec![0f32; c * c];
        gemm((c, dk, c), (q, dk as isize, 1), (k, 1, dk as isize), (&mut qk, c as isize, 1), 1.0, 0.0);
        for i in 0..c {
            for j in 0..c {
                let d = if j <= i { decay(i, j) } else { 0.0 };
                kk[i * c + j] = if j < i { kk[i * c + j] * d } else { 0.0 };
                qk[i * c + j] *= d;
            }
        }
        for (rhs, w) in [(&mut vb, dv), (&mut kd, dk)] {
            for i in 1..c {
                for j in 0..i {
                    let l = kk[i * c + j];
                    if l != 0.0 {
                        let (done, rest) = rhs.split_at_mut(i * w);
                        for (a, b) in rest[..w].iter_mut().zip(&done[j * w..(j + 1) * w]) {
                            *a -= l * b;
                        }
                    }
                }
            }
        }
        // v_new = X − Y·S ; out = (q∘exp(cum))·S + QK·v_new ; S = S·exp(last) + (k∘exp(last−cum))ᵀ·v_new
        let mut v_new = vb;
        gemm((c, dk, dv), (&kd, dk as isize, 1), (st, dv as isize, 1), (&mut v_new, dv as isize, 1), -1.0, 1.0);
        let mut qe = q.to_vec();
        let mut ke = k.to_vec();
        for i in 0..c {
            let (a, b) = (cum[i].exp(), (last - cum[i]).exp());
            qe[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= a);
            ke[i * dk..(i + 1) * dk].iter_mut().for_each(|x| *x *= b);
        }
        let o = &mut io.out[s0 * dv..(s0 + c) * dv];
        gemm((c, dk, dv), (&qe, dk as isize, 1), (st, dv as isize, 1), (o, dv as isize, 1), 1.0, 0.0);
        gemm((c, c, dv), (&qk, c as isize, 1), (&v_new, dv as isize, 1), (o, dv as isize, 1), 1.0, 1.0);
        let e = last.exp();
        st.iter_mut().for_each(|x| *x *= e);
        gemm((dk, c, dv), (&ke, 1, dk as isize), (&v_new, dv as isize, 1), (st, dv as isize, 1), 1.0, 1.0);
        s0 += c;
    }
}

/// MXCSR's flush-to-zero and denormals-are-zero on this thread for the life of the guard (dropped on
/// unwinding too), then the caller's mode again.
struct FlushDenormals(#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] u32);

impl FlushDenormals {
    fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let mut old = 0u32;
            // SAFETY: stmxcsr/ldmxcsr read and write this thread's MXCSR through a local.
            unsafe {
                std::arch::asm!("stmxcsr [{p}]", p = in(reg) &mut old as *mut u32, options(nostack));
                let new = old | 0x8040;
                std::arch::asm!("ldmxcsr [{p}]", p = in(reg) &new as *const u32, options(nostack, readonly));
            }
            FlushDenormals(old)
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushDenormals(0)
    }
}

impl Drop for FlushDenormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the MXCSR value read in `new`.
        unsafe {
            std::arch::asm!("ldmxcsr [{p}]", p = in(reg) &self.0 as *const u32, options(nostack, readonly));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::norm::l2_norm;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    /// Inside the guard a product below f32's smallest normal is zero; after it, the caller's mode is
    /// back (the product is a denormal again). Mutation-checked: a guard that does not restore fails.
    #[test]
    fn denormals_are_flushed_inside_the_guard_only() {
        let tiny = || std::hint::black_box(1e-30f32) * std::hint::black_box(1e-10f32);
        assert!(tiny() > 0.0, "this thread starts with denormals on");
        {
            let _flush = FlushDenormals::new();
            if cfg!(target_arch = "x86_64") {
                assert_eq!(tiny(), 0.0);
            }
        }
        assert!(tiny() > 0.0 && tiny() < f32::MIN_POSITIVE);
    }

    /// Fast-forgetting heads (decays to exp(-190) over a chunk, so denormals would arise and are flushed
    /// in the chunked form, while the token-by-token form keeps them) give the same outputs and state.
    #[test]
    fn chunked_equals_recurrent_with_fast_forgetting_heads() {
        let s = GdnShape { nk: 1, nv: 2, dk: 16, dv: 8 };
        let mut seed = 11;
        let n = 150;
        let mut q: Vec<f32> = (0..n * s.dk).map(|_| lcg(&mut seed)).collect();
        let mut k: Vec<f32> = (0..n * s.dk).map(|_| lcg(&mut seed)).collect();
        l2_norm(&mut q, s.dk, 1e-6);
        l2_norm(&mut k, s.dk, 1e-6);
        let v: Vec<f32> = (0..n * s.nv * s.dv).map(|_| lcg(&mut seed)).collect();
        let g: Vec<f32> = (0..n * s.nv).map(|_| -3.0 + lcg(&mut seed)).collect();
        let beta: Vec<f32> = (0..n * s.nv).map(|_| lcg(&mut seed) + 0.5).collect();
        let inp = DeltaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let (mut s1, mut s2) = (vec![0.1; s.state_len()], vec![0.1; s.state_len()]);
        let (mut o1, mut o2) = (vec![0.0; n * s.nv * s.dv], vec![0.0; n * s.nv * s.dv]);
        gated_delta_recurrent(s, inp, &mut s1, &mut o1);
        gated_delta_chunked(s, inp, &mut s2, &mut o2);
        let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(diff(&o1, &o2) < 2e-5 && diff(&s1, &s2) < 2e-5, "{} {}", diff(&o1, &o2), diff(&s1, &s2));
        assert!(o2.iter().any(|v| v.abs() > 0.1), "the outputs are not all decayed away");
    }

    #[test]
    fn chunked_equals_recurrent_across_chunk_boundaries() {
        let s = GdnShape { nk: 2, nv: 4, dk: 8, dv: 6 };
        let mut seed = 7;
        for n in [1usize, 5, 64, 65, 150] {
            let mut q: Vec<f32> = (0..n * s.nk * s.dk).map(|_| lcg(&mut seed)).collect();
            let mut k: Vec<f32> = (0..n * s.nk * s.dk).map(|_| lcg(&mut seed)).collect();
            l2_norm(&mut q, s.dk, 1e-6);
            l2_norm(&mut k, s.dk, 1e-6);
            let v: Vec<f32> = (0..n * s.nv * s.dv).map(|_| lcg(&mut seed)).collect();
            let g: Vec<f32> = (0..n * s.nv).map(|_| -(lcg(&mut seed) + 0.5) * 0.3).collect();
            let beta: Vec<f32> = (0..n * s.nv).map(|_| lcg(&mut seed) + 0.5).collect();
            let inp = DeltaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            let init: Vec<f32> = (0..s.state_len()).map(|_| lcg(&mut seed)).collect();
            let (mut s1, mut s2) = (init.clone(), init);
            let (mut o1, mut o2) = (vec![0.0; n * s.nv * s.dv], vec![0.0; n * s.nv * s.dv]);
            gated_delta_recurrent(s, inp, &mut s1, &mut o1);
            gated_delta_chunked(s, inp, &mut s2, &mut o2);
            // Two f32 evaluation orders of the same recurrence over <= 150 steps of O(1) values.
            let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff(&o1, &o2) < 2e-5, "n={n} out diff {}", diff(&o1, &o2));
            assert!(diff(&s1, &s2) < 2e-5, "n={n} state diff {}", diff(&s1, &s2));
        }
    }

    /// In pieces with the state carried equals in one call; 40 rows in one call split across the pool
    /// (more than 16), the pieces do not.
    #[test]
    fn conv_with_state_equals_conv_over_concatenation() {
        let (c, kern, n) = (3usize, 4usize, 40usize);
        let w: Vec<f32> = (0..c * kern).map(|i| i as f32 * 0.1 - 0.5).collect();
        let x: Vec<f32> = (0..n * c).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut st = vec![0f32; (kern - 1) * c];
        let mut full = vec![0f32; x.len()];
        causal_conv_silu(&x, c, &w, kern, &mut st, &mut full);
        let mut st2 = vec![0f32; (kern - 1) * c];
        let mut parts = vec![0f32; x.len()];
        for (a, b) in [(0, 4), (4, 5), (5, 16), (16, 30), (30, 40)] {
            causal_conv_silu(&x[a * c..b * c], c, &w, kern, &mut st2, &mut parts[a * c..b * c]);
        }
        assert_eq!(full, parts);
        assert_eq!(st, st2);
        assert_eq!(&st[..], &x[(n - kern + 1) * c..]);
    }
}
