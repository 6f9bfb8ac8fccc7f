//! Gated DeltaNet on the device (`kernels/recurrent.cu`). The delta rule runs token by token for prefill
//! as for decode: the same answer as the CPU's chunked form within its own chunked-vs-recurrent bound,
//! and the CPU's recurrent form to the bit. A chunked (UT/WY) kernel is the later, faster prefill.

use std::ops::Range;

use osprey_backend::{DType, GdnShape, RecurrentOps, Result, Tensor};

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
        _recurrent: bool,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let n = q.rows();
        let out = self.empty(DType::F32, &[n, shape.nv * shape.dv])?;
        let call = launch::gated_delta_recurrent(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(g),
            ptr(beta),
            ptr(state),
            ptr(&out),
            u32_of(n),
            u32_of(shape.nk),
            u32_of(shape.nv),
            u32_of(shape.dk),
            u32_of(shape.dv),
        );
        let cfg = LaunchConfig::per_group(shape.nv, (shape.dv.div_ceil(32) * 32).min(1024) as u32);
        self.try_run(call, cfg)?;
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
        let n = q.rows();
        let out = self.empty(DType::F32, &[n, shape.nv * shape.dv])?;
        let table = self.state_table(states)?;
        let (nk, nv, dk, dv) = (u32_of(shape.nk), u32_of(shape.nv), u32_of(shape.dk), u32_of(shape.dv));
        let call = launch::gated_delta_rows(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(g),
            ptr(beta),
            table.ptr,
            ptr(&out),
            u32_of(n),
            nk,
            nv,
            dk,
            dv,
        );
        let block = (shape.dv.div_ceil(32) * 32).min(1024) as u32;
        self.try_run(call, LaunchConfig { grid: [u32_of(shape.nv), u32_of(n), 1], block: [block, 1, 1] })?;
        Ok(out)
    }
}

impl CudaBackend {
    /// The device addresses of `states`, uploaded as a table (`u64` each, as `slot_tables` uploads the
    /// slots' addresses) for a kernel over several sequences.
    fn state_table(&self, states: &[&mut Tensor]) -> Result<super::Buf> {
        let bytes: Vec<u8> = states.iter().flat_map(|t| ptr(t).0.to_le_bytes()).collect();
        self.upload_bytes(&bytes)
    }
}
