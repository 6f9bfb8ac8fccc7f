//! Core tensor ops on the device: `kernels/linear.cu` for every weight type, `elementwise.cu`,
//! `norm.cu`, `rope.cu`, and `memory.cu`'s embedding gather. Rotary tables are computed where the
//! positions are (the host) and uploaded once per forward, as on the CPU.

use osprey_backend::{
    BackendError, CoreOps, DType, HostData, MRope, MemoryOps, Result, RopeTable, RowSampling, Tensor,
};

use super::{ptr, u32_of, CudaBackend, CudaStorage};
use crate::device::{DevPtr, DeviceError, DeviceLayer as _, GemmBf16, LaunchConfig};
use crate::launch;

/// The linear kernels' code for a weight type.
pub(super) fn wtype(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::BF16 => Ok(1),
        DType::F16 => Ok(2),
        DType::Nvfp4 => Ok(3),
        other => Err(BackendError::Device(format!("a {other:?} weight has no linear kernel: this is a bug"))),
    }
}

/// Rows up to which a linear runs as a GEMV (`linear_gemv` keeps one accumulator per row).
pub(super) const GEMV_ROWS: usize = 8;

/// The widest head `rms_norm_rope_f32` and `kv_write_rope` hold in shared memory (`hs[256]`).
pub(super) const NORM_ROPE_MAX_D: usize = 256;

/// Threads for a block reducing `group` values: a multiple of 32 from 32 to 256.
pub(super) fn threads_for(group: usize) -> u32 {
    (group.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// Which RMSNorm: `x̂·w`, `x̂·(1+w)`, or gated by `silu(z)` or `sigmoid(z)`.
#[derive(Clone, Copy)]
pub(super) enum Form<'a> {
    Plain,
    OnePlus,
    Silu(&'a Tensor),
    Sigmoid(&'a Tensor),
}

impl CudaBackend {
    /// RMSNorm of `x` in groups of `group`, weight `w` indexed by column modulo its length.
    pub(super) fn rms(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32, form: Form<'_>) {
        let groups = x.numel() / group;
        let (zp, one_plus, gate) = match form {
            Form::Plain => (ptr(x), false, 0),
            Form::OnePlus => (ptr(x), true, 0),
            Form::Silu(z) => (ptr(z), false, 1),
            Form::Sigmoid(z) => (ptr(z), false, 2),
        };
        let (cols, w_len) = (u32_of(x.cols()), u32_of(w.numel()));
        let call = launch::rms_norm_f32(ptr(x), ptr(w), zp, cols, u32_of(group), w_len, eps, i32::from(one_plus), gate);
        self.run(call, LaunchConfig::per_group(groups, threads_for(group)));
    }

    /// Runs a grid-stride element-wise kernel over `x`'s elements.
    pub(super) fn each<const N: usize>(&self, x: &Tensor, call: launch::Call<N>) {
        self.run(call, LaunchConfig::elements(x.numel()));
    }
}

/// A weight's device memory as the linear kernel reads it.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawWeight {
    pub(super) data: DevPtr,
    /// NVFP4's e4m3 scales (any pointer for the other types).
    pub(super) scales: DevPtr,
    pub(super) global: f32,
    pub(super) dtype: DType,
}

impl CudaBackend {
    /// `x [m, k] · wᵀ → [m, n]` as one bf16 GEMM (cuBLAS's `GemmEx` on a GPU): activations rounded to
    /// bf16, an NVFP4 weight widened to bf16 first. `None` where the device has no BLAS.
    fn gemm(&self, x: &Tensor, w: RawWeight, n: usize, k: usize) -> Result<Option<Tensor>> {
        let m = x.rows();
        let xb = self.empty(DType::BF16, &[m, k])?;
        self.try_run(launch::f32_to_bf16_rows(ptr(x), ptr(&xb), u32_of(m * k)), LaunchConfig::elements(m * k))?;
        let widened;
        let wb = match w.dtype {
            DType::BF16 => w.data,
            _ => {
                widened = self.empty(DType::BF16, &[n, k])?;
                let call = launch::nvfp4_to_bf16(w.data, w.scales, w.global, ptr(&widened), u32_of(n * k));
                self.try_run(call, LaunchConfig::elements(n * k))?;
                super::ptr(&widened)
            }
        };
        let out = self.empty(DType::F32, &[m, n])?;
        // Row-major `out [m, n] = x [m, k] · w [n, k]ᵀ` is column-major `outᵀ (n × m) = wᵀᵀ · xᵀ`: A = w
        // (k × n column-major, transposed), B = x (k × m column-major).
        let g = GemmBf16 {
            transa: true,
            transb: false,
            m: n,
            n: m,
            k,
            a: (wb, k),
            b: (super::ptr(&xb), k),
            c: (super::ptr(&out), n),
            alpha: 1.0,
            beta: 0.0,
        };
        match self.dev.gemm_bf16(g) {
            Ok(()) => Ok(Some(out)),
            Err(DeviceError::Unavailable(_)) => Ok(None),
            Err(e) => Err(super::seam_error(e)),
        }
    }

    /// `x [m, k] · wᵀ → [m, n]` (a placed weight, or an expert's projection in a slot).
    /// Whether `m` rows against a weight of `dtype` and width `k` take the f32-activation GEMV (decode
    /// shapes off the int8 path): `linear_gemv` and the launches that fuse several of its products.
    fn on_gemv(&self, m: usize, dtype: DType, k: usize) -> bool {
        (1..=GEMV_ROWS).contains(&m) && !self.q8_path(m, dtype, k)
    }

    pub(super) fn matmul(&self, x: &Tensor, w: RawWeight, n: usize, k: usize) -> Result<Tensor> {
        let m = x.rows();
        if self.q8_path(m, w.dtype, k) || self.mma_path(m, w.dtype, k) {
            return self.linear_int8(x, w, n);
        }
        let fast = self.precision == osprey_backend::Precision::Int8 && matches!(w.dtype, DType::BF16 | DType::Nvfp4);
        if fast && m > GEMV_ROWS {
            if let Some(out) = self.gemm(x, w, n, k)? {
                return Ok(out);
            }
        }
        let wtype = wtype(w.dtype)?;
        let out = self.empty(DType::F32, &[m, n])?;
        let (x, o, mnk) = (ptr(x), ptr(&out), (u32_of(m), u32_of(n), u32_of(k)));
        // Decode (a few rows): a warp per output column reads each weight once for every row; prefill:
        // 16×16 tiles through shared memory.
        if (1..=GEMV_ROWS).contains(&m) {
            let cfg = LaunchConfig { grid: [n.div_ceil(8) as u32, 1, 1], block: [256, 1, 1] };
            self.try_run(launch::linear_gemv(x, w.data, w.scales, w.global, wtype, o, mnk.0, mnk.1, mnk.2), cfg)?;
        } else {
            let cfg =
                LaunchConfig { grid: [n.div_ceil(16) as u32, m.div_ceil(16).max(1) as u32, 1], block: [16, 16, 1] };
            self.try_run(launch::linear_tiled(x, w.data, w.scales, w.global, wtype, o, mnk.0, mnk.1, mnk.2), cfg)?;
        }
        Ok(out)
    }
}

/// A placed weight's device memory as the linear kernels read it.
fn placed(w: &Tensor) -> Result<RawWeight> {
    let Some(CudaStorage::Weight(placed)) = w.storage::<CudaStorage>() else {
        return Err(BackendError::Device("linear over a tensor that is not a placed weight: this is a bug".into()));
    };
    let scales = placed.scales.as_ref().map_or(placed.data.ptr, |s| s.ptr);
    Ok(RawWeight { data: placed.data.ptr, scales, global: placed.global, dtype: w.dtype() })
}

impl CoreOps for CudaBackend {
    fn sample_rows(&self, logits: &[&Tensor], rows: &[&RowSampling]) -> Result<Tensor> {
        self.sample(logits, rows)
    }

    fn linear_pair(&self, x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<(Tensor, Tensor)> {
        let mut out = self.linear_many(x, &[w1, w2])?.into_iter();
        match (out.next(), out.next()) {
            (Some(a), Some(b)) => Ok((a, b)),
            _ => Err(BackendError::Device("linear_many lost a product: this is a bug".into())),
        }
    }

    fn linear_many(&self, x: &Tensor, ws: &[&Tensor]) -> Result<Vec<Tensor>> {
        let m = x.rows();
        let placed: Vec<RawWeight> = ws.iter().map(|w| placed(w)).collect::<Result<_>>()?;
        // Decode-shaped products on the f32-activation GEMV, up to four: one launch (a layer's
        // projections of one input, an MLP's gate and up). Other shapes, the int8 paths, more weights:
        // one linear each.
        let gemv = |w: &&Tensor, p: &RawWeight| w.cols() == x.cols() && self.on_gemv(m, p.dtype, w.cols());
        if !(2..=4).contains(&ws.len()) || !ws.iter().zip(&placed).all(|(w, p)| gemv(w, p)) {
            return ws.iter().zip(&placed).map(|(w, p)| self.matmul(x, *p, w.shape()[0], w.cols())).collect();
        }
        let outs: Vec<Tensor> = ws.iter().map(|w| self.empty(DType::F32, &[m, w.shape()[0]])).collect::<Result<_>>()?;
        // Absent weights: no columns, and the first weight's addresses (a launch names no null address).
        let part = |i: usize| -> Result<(RawWeight, i32, DevPtr, u32)> {
            let (j, n) = if i < ws.len() { (i, u32_of(ws[i].shape()[0])) } else { (0, 0) };
            Ok((placed[j], wtype(placed[j].dtype)?, ptr(&outs[j]), n))
        };
        let (p0, p1, p2, p3) = (part(0)?, part(1)?, part(2)?, part(3)?);
        let call = launch::linear_gemv_many(
            ptr(x),
            u32_of(m),
            u32_of(x.cols()),
            p0.0.data,
            p0.0.scales,
            p0.0.global,
            p0.1,
            p0.2,
            p0.3,
            p1.0.data,
            p1.0.scales,
            p1.0.global,
            p1.1,
            p1.2,
            p1.3,
            p2.0.data,
            p2.0.scales,
            p2.0.global,
            p2.1,
            p2.2,
            p2.3,
            p3.0.data,
            p3.0.scales,
            p3.0.global,
            p3.1,
            p3.2,
            p3.3,
        );
        let cols: usize = ws.iter().map(|w| w.shape()[0]).sum();
        self.try_run(call, LaunchConfig { grid: [cols.div_ceil(8) as u32, 1, 1], block: [256, 1, 1] })?;
        Ok(outs)
    }

    fn linear_swiglu(&self, x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let (a, b) = (placed(gate)?, placed(up)?);
        let (m, n, k) = (x.rows(), gate.shape()[0], gate.cols());
        let same = gate.dtype() == up.dtype() && gate.shape() == up.shape();
        // Where the pair is one GEMV launch of one weight type, the SwiGLU is too; elsewhere the pair,
        // then `silu_mul`.
        if !same || !self.on_gemv(m, a.dtype, k) {
            let (mut g, u) = self.linear_pair(x, gate, up)?;
            self.silu_mul(&mut g, &u);
            return Ok(g);
        }
        let out = self.empty(DType::F32, &[m, n])?;
        let call = launch::linear_gemv_swiglu(
            ptr(x),
            a.data,
            a.scales,
            a.global,
            b.data,
            b.scales,
            b.global,
            wtype(a.dtype)?,
            ptr(&out),
            u32_of(m),
            u32_of(n),
            u32_of(k),
        );
        self.try_run(call, LaunchConfig { grid: [n.div_ceil(8) as u32, 1, 1], block: [256, 1, 1] })?;
        Ok(out)
    }

    fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        self.matmul(x, placed(w)?, w.shape()[0], w.cols())
    }

    fn embed(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let dtype = match table.dtype() {
            DType::F32 => 0,
            DType::BF16 => 1,
            DType::F16 => 2,
            other => return Err(BackendError::Device(format!("a {other:?} embedding table has no CUDA gather yet"))),
        };
        let cols = table.cols();
        let out = self.empty(DType::F32, &[ids.len(), cols])?;
        if ids.is_empty() {
            return Ok(out);
        }
        let v: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let idt = self.upload(HostData::I32(&v), &[v.len()])?;
        let call = launch::embed_rows(ptr(table), dtype, ptr(&idt), ptr(&out), u32_of(ids.len()), u32_of(cols));
        self.try_run(call, LaunchConfig::elements(ids.len() * cols))?;
        Ok(out)
    }

    fn add(&self, x: &mut Tensor, y: &Tensor) {
        self.each(x, launch::add_f32(ptr(x), ptr(y), u32_of(x.numel())));
    }

    fn add_bias(&self, x: &mut Tensor, bias: &Tensor) {
        self.each(x, launch::add_bias_f32(ptr(x), ptr(bias), u32_of(x.numel()), u32_of(bias.numel())));
    }

    fn scale(&self, x: &mut Tensor, s: f32) {
        self.each(x, launch::scale_f32(ptr(x), s, u32_of(x.numel())));
    }

    fn silu_mul(&self, gate: &mut Tensor, up: &Tensor) {
        self.each(gate, launch::silu_mul_f32(ptr(gate), ptr(up), u32_of(gate.numel())));
    }

    fn sigmoid_mul(&self, x: &mut Tensor, gate: &Tensor) {
        self.each(x, launch::sigmoid_mul_f32(ptr(x), ptr(gate), u32_of(x.numel())));
    }

    fn add_sigmoid_gated(&self, out: &mut Tensor, y: &Tensor, gate: &Tensor) {
        let call = launch::add_sigmoid_gated_f32(ptr(out), ptr(y), ptr(gate), u32_of(out.numel()), u32_of(out.cols()));
        self.each(out, call);
    }

    fn gelu(&self, x: &mut Tensor, tanh: bool) {
        self.each(x, launch::gelu_f32(ptr(x), u32_of(x.numel()), i32::from(tanh)));
    }

    fn rms_norm(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool) {
        self.rms(x, w, w.numel(), eps, if one_plus { Form::OnePlus } else { Form::Plain });
    }

    fn add_rms_norm(&self, x: &mut Tensor, y: &Tensor, w: &Tensor, eps: f32, one_plus: bool) -> Result<Tensor> {
        let cols = x.cols();
        if w.numel() != cols || y.numel() != x.numel() {
            return Err(BackendError::Device(format!(
                "add_rms_norm of {:?} + {:?} with a weight of {}: this is a bug",
                x.shape(),
                y.shape(),
                w.numel()
            )));
        }
        let out = self.empty(DType::F32, x.shape())?;
        let call = launch::add_rms_norm_f32(ptr(x), ptr(y), ptr(w), ptr(&out), u32_of(cols), eps, i32::from(one_plus));
        self.try_run(call, LaunchConfig::per_group(x.numel() / cols.max(1), threads_for(cols)))?;
        Ok(out)
    }

    fn rms_norm_gated(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        self.rms(x, w, w.numel(), eps, Form::Silu(z));
    }

    fn l2_norm(&self, x: &mut Tensor, group: usize, eps: f32) {
        let cfg = LaunchConfig::per_group(x.numel() / group, threads_for(group));
        self.run(launch::l2_norm_f32(ptr(x), u32_of(group), eps), cfg);
    }

    fn layer_norm(&self, x: &mut Tensor, w: &Tensor, b: &Tensor, eps: f32) {
        let cols = w.numel();
        let cfg = LaunchConfig::per_group(x.numel() / cols, threads_for(cols));
        self.run(launch::layer_norm_f32(ptr(x), ptr(w), ptr(b), u32_of(cols), eps), cfg);
    }

    fn rope(&self, x: &mut Tensor, rope: &MRope, table: &RopeTable) {
        self.rotate_half(x, rope.head_dim(), &table.cos, &table.sin);
    }

    fn rms_norm_rope(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool, rope: &MRope, table: &RopeTable) {
        let hd = w.numel();
        // One block a head, held in shared memory; anything else as the two launches.
        if hd != rope.head_dim() || hd == 0 || hd > NORM_ROPE_MAX_D || !x.cols().is_multiple_of(hd) {
            self.rms_norm(x, w, eps, one_plus);
            return self.rope(x, rope, table);
        }
        let (heads, half) = (u32_of(x.cols() / hd), u32_of(table.cos.cols()));
        let call = launch::rms_norm_rope_f32(
            ptr(x),
            ptr(w),
            ptr(&table.cos),
            ptr(&table.sin),
            heads,
            u32_of(hd),
            half,
            eps,
            i32::from(one_plus),
        );
        self.run(call, LaunchConfig::per_group(x.numel() / hd, threads_for(hd)));
    }

    fn rotate_half(&self, x: &mut Tensor, head_dim: usize, cos: &Tensor, sin: &Tensor) {
        let (rows, cols, half) = (x.rows(), x.cols(), cos.cols());
        let (r, c, hd, h) = (u32_of(rows), u32_of(cols), u32_of(head_dim), u32_of(half));
        let call = launch::rotate_half_f32(ptr(x), ptr(cos), ptr(sin), r, c, hd, h);
        self.run(call, LaunchConfig::elements(rows * (cols / head_dim) * half));
    }
}
