//! Gated DeltaNet on the device (`kernels/recurrent.cu`, `kernels/delta_chunked.cu`), the state on chip:
//! the recurrent form (decode, verify steps) the CPU's to the bit, a block's 32 state columns read once
//! and written once per launch; a decode step from the conv's output in one launch (split, L2 norms,
//! scale, gates and the rule fused); prefill in the CPU's chunked form, its state-free part for a
//! window of chunks at once and the state's part chunk after chunk, within the chunked-vs-recurrent
//! bound of the CPU's.

use std::ops::Range;

use osprey_backend::{BackendError, DType, GdnShape, RecurrentOps, Result, Tensor};

use super::{ptr, u32_of, CudaBackend};
use crate::device::LaunchConfig;
use crate::launch;

impl RecurrentOps for CudaBackend {
    fn causal_conv_silu(
        &self,
        x: &Tensor,
        rows: Range<usize>,
        w: &Tensor,
        kernel: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        assert!((2..=9).contains(&kernel), "conv kernels of 2 to 9 taps: this is a bug");
        let c = x.cols();
        let out = self.empty(DType::F32, &[rows.len(), c])?;
        let call = launch::causal_conv_silu(
            ptr(x),
            u32_of(rows.start),
            u32_of(rows.len()),
            u32_of(c),
            ptr(w),
            u32_of(kernel),
            ptr(state),
            ptr(&out),
        );
        self.try_run(call, LaunchConfig::elements(c))?;
        Ok(out)
    }

    fn delta_gates(
        &self,
        a: &Tensor,
        b: &Tensor,
        rows: Range<usize>,
        neg_a: &Tensor,
        dt_bias: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let (n, nv) = (rows.len(), a.cols());
        let beta = self.empty(DType::F32, &[n, nv])?;
        let g = self.empty(DType::F32, &[n, nv])?;
        let call = launch::delta_gates(
            ptr(a),
            ptr(b),
            u32_of(rows.start),
            u32_of(n),
            u32_of(nv),
            ptr(neg_a),
            ptr(dt_bias),
            ptr(&beta),
            ptr(&g),
        );
        self.try_run(call, LaunchConfig::elements(n * nv))?;
        Ok((beta, g))
    }

    fn gated_delta(
        &self,
        shape: GdnShape,
        recurrent: bool,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        on_chip(shape)?;
        let n = q.rows();
        let out = self.empty(DType::F32, &[n, shape.nv * shape.dv])?;
        if recurrent {
            self.delta_slab(shape, [q, k, v, g, beta], (ptr(state), false), &out)?;
        } else {
            self.delta_chunked(shape, [q, k, v, g, beta], state, &out)?;
        }
        Ok(out)
    }

    fn causal_conv_silu_rows(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        states: &mut [&mut Tensor],
    ) -> Result<Tensor> {
        assert!((2..=9).contains(&kernel), "conv kernels of 2 to 9 taps: this is a bug");
        let (n, c) = (x.rows(), x.cols());
        let out = self.empty(DType::F32, &[n, c])?;
        let table = self.state_table(states)?;
        let call =
            launch::causal_conv_silu_rows(ptr(x), u32_of(n), u32_of(c), ptr(w), u32_of(kernel), table.ptr, ptr(&out));
        self.try_run(call, LaunchConfig::elements(n * c))?;
        Ok(out)
    }

    fn gated_delta_rows(
        &self,
        shape: GdnShape,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        states: &mut [&mut Tensor],
    ) -> Result<Tensor> {
        on_chip(shape)?;
        let n = q.rows();
        let out = self.empty(DType::F32, &[n, shape.nv * shape.dv])?;
        let table = self.state_table(states)?;
        self.delta_slab(shape, [q, k, v, g, beta], (table.ptr, true), &out)?;
        Ok(out)
    }

    fn gated_delta_step(
        &self,
        shape: GdnShape,
        conv: &Tensor,
        a: &Tensor,
        b: &Tensor,
        rows: Range<usize>,
        neg_a: &Tensor,
        dt_bias: &Tensor,
        q_scale: f32,
        states: &mut [&mut Tensor],
    ) -> Result<Tensor> {
        on_chip(shape)?;
        let n = conv.rows();
        assert!(n == rows.len() && n == states.len(), "a decode step: a row per state: this is a bug");
        let out = self.empty(DType::F32, &[n, shape.nv * shape.dv])?;
        // One sequence takes its state's address as an argument: no table to upload.
        let table = match states {
            [_] => None,
            _ => Some(self.state_table(states)?),
        };
        let (nk, nv, dk, dv) = dims(shape);
        let call = launch::gated_delta_step(
            ptr(conv),
            ptr(a),
            ptr(b),
            u32_of(rows.start),
            ptr(neg_a),
            ptr(dt_bias),
            q_scale,
            table.as_ref().map_or_else(|| ptr(states[0]), |t| t.ptr),
            u32::from(table.is_some()),
            ptr(&out),
            nk,
            nv,
            dk,
            dv,
        );
        self.try_run(call, slab_blocks(shape, n))?;
        Ok(out)
    }
}

/// The largest key head dimension the kernels' shared state slab holds (`DELTA_DK_MAX`, common.cuh).
const DK_MAX: usize = 256;
/// Tokens of a chunk of the chunked form (`DELTA_CHUNK`, delta_chunked.cu; the CPU's `CHUNK`).
const CHUNK: usize = 64;
/// The chunked form's scratch for a window of chunks is at most this (or the backend's scratch cap, or
/// one chunk): a prefill of any length runs in windows, its memory bounded (Qwen3.5-35B-A3B: ~2.6 MB a
/// chunk, 6 chunks a window).
const WINDOW_BYTES: usize = 16 << 20;

fn on_chip(shape: GdnShape) -> Result<()> {
    if shape.dk > DK_MAX || shape.nk == 0 || !shape.nv.is_multiple_of(shape.nk) {
        return Err(BackendError::Device(format!(
            "Gated DeltaNet with key heads of {} (at most {DK_MAX}) and {} value heads over {} key heads: not supported on the CUDA backend",
            shape.dk, shape.nv, shape.nk
        )));
    }
    Ok(())
}

fn dims(s: GdnShape) -> (u32, u32, u32, u32) {
    (u32_of(s.nk), u32_of(s.nv), u32_of(s.dk), u32_of(s.dv))
}

/// A block of 32 threads per 32 state columns of each value head, `rows` deep in y.
fn slab_blocks(s: GdnShape, rows: usize) -> LaunchConfig {
    LaunchConfig { grid: [u32_of(s.nv * s.dv.div_ceil(32)), u32_of(rows), 1], block: [32, 1, 1] }
}

impl CudaBackend {
    /// The recurrent rule (`gated_delta_slab`) over `q.rows()` tokens into `out`: on the one state at
    /// `states` (`table` false), or a token each on the states whose addresses `states` holds.
    fn delta_slab(
        &self,
        shape: GdnShape,
        [q, k, v, g, beta]: [&Tensor; 5],
        (states, table): (crate::device::DevPtr, bool),
        out: &Tensor,
    ) -> Result<()> {
        let (n, (nk, nv, dk, dv)) = (q.rows(), dims(shape));
        let call = launch::gated_delta_slab(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(g),
            ptr(beta),
            states,
            u32::from(table),
            ptr(out),
            u32_of(n),
            nk,
            nv,
            dk,
            dv,
        );
        self.try_run(call, slab_blocks(shape, if table { n } else { 1 }))
    }

    /// The chunked form over `q.rows()` tokens: per window of chunks, the state-free part of every chunk
    /// at once, then the state's part chunk after chunk.
    fn delta_chunked(
        &self,
        s: GdnShape,
        [q, k, v, g, beta]: [&Tensor; 5],
        state: &mut Tensor,
        out: &Tensor,
    ) -> Result<()> {
        let n = q.rows();
        let per_chunk = s.nv * CHUNK * (s.dv + s.dk + CHUNK + 1);
        let window = (WINDOW_BYTES.min(self.scratch_cap) / (4 * per_chunk)).max(1).min(n.div_ceil(CHUNK));
        let [x, y, a, cum] = [s.dv, s.dk, CHUNK, 1].map(|w| self.empty(DType::F32, &[window * s.nv * CHUNK * w]));
        let (x, y, a, cum) = (x?, y?, a?, cum?);
        let (nk, nv, dk, dv) = dims(s);
        for first in (0..n.div_ceil(CHUNK)).step_by(window) {
            let chunks = window.min(n.div_ceil(CHUNK) - first);
            let t0 = u32_of(first * CHUNK);
            let prep = launch::gated_delta_chunk_prep(
                ptr(q),
                ptr(k),
                ptr(v),
                ptr(g),
                ptr(beta),
                t0,
                u32_of(n),
                ptr(&x),
                ptr(&y),
                ptr(&a),
                ptr(&cum),
                nk,
                nv,
                dk,
                dv,
            );
            self.try_run(prep, LaunchConfig { grid: [nv, u32_of(chunks), 1], block: [256, 1, 1] })?;
            let run = launch::gated_delta_chunk_state(
                ptr(q),
                ptr(k),
                ptr(&x),
                ptr(&y),
                ptr(&a),
                ptr(&cum),
                ptr(state),
                ptr(out),
                t0,
                u32_of(n),
                u32_of(chunks),
                nk,
                nv,
                dk,
                dv,
            );
            self.try_run(run, LaunchConfig { grid: [u32_of(s.nv * s.dv.div_ceil(32)), 1, 1], block: [512, 1, 1] })?;
        }
        Ok(())
    }

    /// The device addresses of `states`, uploaded as a table (`u64` each, as `slot_tables` uploads the
    /// slots' addresses) for a kernel over several sequences.
    fn state_table(&self, states: &[&mut Tensor]) -> Result<super::Buf> {
        let bytes: Vec<u8> = states.iter().flat_map(|t| ptr(t).0.to_le_bytes()).collect();
        self.upload_bytes(&bytes)
    }
}
