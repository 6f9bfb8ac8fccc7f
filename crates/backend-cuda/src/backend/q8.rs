//! NVFP4 × int8 products at the fast activations (`Precision::Int8`), the reading the CPU backend gives
//! it (`osprey_kernels::q8`, `q8_gemm`): activations quantised once to int8 per 16-value block, weights'
//! codes to int8 by a register table. Decode-shaped steps (at most [`GEMV_ROWS`] rows) take `dp4a`
//! (`kernels/linear_q8.cu`): a dense NVFP4 linear is a quantisation and `linear_q8_gemv`; the routed
//! experts are two launches — the gather, its quantisation, gate and up with SwiGLU (its output
//! quantised) in one, down with the routing weight into `partials` in the other — where the f32 path
//! takes six (for hidden sizes up to [`Q8_MAX_HIDDEN`]).
//! Prefill-shaped ones take the tensor cores (`kernels/gemm_q8.cu`: `mma.sync` m16n8k16 on int8,
//! `ldmatrix`, `cp.async`): a dense NVFP4 linear is a quantisation and `linear_mma_q8`, the routed
//! experts one grouped launch per projection (`linear_grouped_mma_q8`) for every expert's rows.

use osprey_backend::{DType, ExpertShape, Precision, Result, Tensor};

use super::core::{RawWeight, GEMV_ROWS};
use super::experts::OnDevice;
use super::{ptr, u32_of, CudaBackend};
use crate::device::{DevPtr, LaunchConfig};
use crate::launch;

/// Widths the int8 path takes: whole 64-column chunks, as the CPU's (`q8::CHUNK`), so that both backends
/// quantise the same matmuls (the kernels need multiples of 32).
pub(super) const Q8_COLS: usize = 64;

/// The widest hidden size whose decode experts take the fused int8 kernels (`GU_MAX_HIDDEN` in
/// `kernels/linear_q8.cu`: the rows it quantises into shared memory).
pub(super) const Q8_MAX_HIDDEN: usize = 4096;

/// Widths the tensor-core GEMM takes: whole 32-value steps (two NVFP4 blocks).
pub(super) const MMA_COLS: usize = 32;

/// Rows and columns of a tensor-core GEMM block's tile (`mma_q8_tile` in `kernels/gemm_q8.cu`): dense
/// products 64 × 64, an expert's few rows 16 × 128.
const MMA_TILE: usize = 64;
const MMA_EXPERT_TILE: (usize, usize) = (16, 128);

impl CudaBackend {
    /// Whether `m` rows against an NVFP4 matrix of width `k` take the int8 path.
    pub(super) fn q8_path(&self, m: usize, dtype: DType, k: usize) -> bool {
        self.precision == Precision::Int8
            && dtype == DType::Nvfp4
            && (1..=GEMV_ROWS).contains(&m)
            && k.is_multiple_of(Q8_COLS)
    }

    /// Whether `m` rows against an NVFP4 matrix of width `k` take the tensor-core GEMM.
    pub(super) fn mma_path(&self, m: usize, dtype: DType, k: usize) -> bool {
        self.precision == Precision::Int8 && dtype == DType::Nvfp4 && m > GEMV_ROWS && k.is_multiple_of(MMA_COLS)
    }

    /// `rows` rows of `x` (row `ids[r]` where `ids` is given) quantised: `([rows, k]` int8 as bytes,
    /// `[rows, k/16]` scales`)`.
    fn quantize_q8(&self, x: &Tensor, ids: Option<DevPtr>, rows: usize) -> Result<(Tensor, Tensor)> {
        let k = x.cols();
        let (q, d) = (self.empty(DType::U8, &[rows, k])?, self.empty(DType::F32, &[rows, k / 16])?);
        let (ids, gather) = ids.map_or((ptr(x), 0), |p| (p, 1));
        let call = launch::quantize_q8(ptr(x), ids, gather, ptr(&q), ptr(&d), u32_of(rows), u32_of(k));
        self.try_run(call, LaunchConfig::elements(rows * k / 16))?;
        Ok((q, d))
    }

    /// `x [m, k] · wᵀ` on int8 activations: `dp4a` for a decode-shaped step ([`Self::q8_path`]), the
    /// tensor cores above ([`Self::mma_path`]). The two kernels take the same operands.
    pub(super) fn linear_int8(&self, x: &Tensor, w: RawWeight, n: usize) -> Result<Tensor> {
        let (m, k) = (x.rows(), x.cols());
        let (q, d) = self.quantize_q8(x, None, m)?;
        let out = self.empty(DType::F32, &[m, n])?;
        let (kernel, cfg) = if m <= GEMV_ROWS {
            (
                launch::linear_q8_gemv as fn(_, _, _, _, _, _, _, _, _) -> _,
                LaunchConfig { grid: [n.div_ceil(8) as u32, 1, 1], block: [256, 1, 1] },
            )
        } else {
            let grid = [n.div_ceil(MMA_TILE) as u32, m.div_ceil(MMA_TILE) as u32, 1];
            (launch::linear_mma_q8 as fn(_, _, _, _, _, _, _, _, _) -> _, LaunchConfig { grid, block: [128, 1, 1] })
        };
        let call = kernel(ptr(&q), ptr(&d), w.data, w.scales, w.global, ptr(&out), u32_of(m), u32_of(n), u32_of(k));
        self.try_run(call, cfg)?;
        Ok(out)
    }

    /// A prefill-shaped wave's routed experts on the tensor cores: the gather with the quantisation, gate
    /// and up (a grouped launch each), SwiGLU, the quantisation, down, and each row times its weight into
    /// its entry of `partials`.
    pub(super) fn experts_mma(
        &self,
        x: &Tensor,
        weights: &Tensor,
        shape: ExpertShape,
        g: &OnDevice,
        partials: &mut Tensor,
    ) -> Result<()> {
        let (hidden, inter) = (shape.hidden, shape.inter);
        let (xq, xd) = self.quantize_q8(x, Some(g.tokens), g.n)?;
        let mut gate = self.grouped_mma(&xq, &xd, g, 0, (inter, hidden))?;
        let up = self.grouped_mma(&xq, &xd, g, 1, (inter, hidden))?;
        osprey_backend::CoreOps::silu_mul(self, &mut gate, &up);
        let (hq, hd) = self.quantize_q8(&gate, None, g.n)?;
        let d = self.grouped_mma(&hq, &hd, g, 2, (hidden, inter))?;
        let call =
            launch::moe_scatter_rows(ptr(partials), g.entries, ptr(weights), ptr(&d), u32_of(g.n), u32_of(hidden));
        self.try_run(call, LaunchConfig::elements(g.n * hidden))
    }

    /// Projection `which` of every group over its quantised rows → `[rows, cols]` (`dims` = (cols, depth)).
    fn grouped_mma(
        &self,
        xq: &Tensor,
        xd: &Tensor,
        g: &OnDevice,
        which: usize,
        (cols, depth): (usize, usize),
    ) -> Result<Tensor> {
        let out = self.empty(DType::F32, &[g.n, cols])?;
        let (w, s, gl) = g.projection(which);
        let call = launch::linear_grouped_mma_q8(
            ptr(xq),
            ptr(xd),
            w,
            s,
            gl,
            g.row0,
            g.rows,
            ptr(&out),
            u32_of(cols),
            u32_of(depth),
        );
        let (rows, width) = MMA_EXPERT_TILE;
        let grid = [cols.div_ceil(width) as u32, g.tall.div_ceil(rows) as u32, g.groups as u32];
        self.try_run(call, LaunchConfig { grid, block: [128, 1, 1] })?;
        Ok(out)
    }

    /// A wave's routed experts on the int8 path, each row's output times its weight into its entry of
    /// `partials` (what `experts.rs`' `run_groups` computes, in two launches).
    pub(super) fn experts_q8(
        &self,
        x: &Tensor,
        weights: &Tensor,
        shape: ExpertShape,
        g: &OnDevice,
        partials: &mut Tensor,
    ) -> Result<()> {
        let (hidden, inter) = (shape.hidden, shape.inter);
        let (hq, hd) = (self.empty(DType::U8, &[g.n, inter])?, self.empty(DType::F32, &[g.n, inter / 16])?);
        let groups = g.groups as u32;
        let call = launch::moe_gate_up_q8(
            ptr(x),
            g.tokens,
            g.w,
            g.s,
            g.g,
            g.row0,
            g.rows,
            groups,
            ptr(&hq),
            ptr(&hd),
            u32_of(inter),
            u32_of(hidden),
        );
        // A block of 16 warps gives 16 columns: one quantisation block of the down projection's input
        // (and quantises its group's rows of `x` itself: no launch for the gather).
        self.try_run(call, LaunchConfig { grid: [(inter / 16) as u32, 1, groups], block: [512, 1, 1] })?;
        let call = launch::moe_down_q8(
            ptr(&hq),
            ptr(&hd),
            g.w,
            g.s,
            g.g,
            g.row0,
            g.rows,
            groups,
            g.entries,
            ptr(weights),
            ptr(partials),
            u32_of(hidden),
            u32_of(inter),
        );
        self.try_run(call, LaunchConfig { grid: [hidden.div_ceil(8) as u32, 1, groups], block: [256, 1, 1] })
    }
}
