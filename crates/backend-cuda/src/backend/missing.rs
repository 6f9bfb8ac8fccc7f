//! The ops no kernel runs yet on this backend: attention, Gated DeltaNet, expert slots and
//! `qwen4_exp`'s hyper-connections, PLE and QSA; and the ones that do in those groups (the router,
//! the grouped norms). `supports` answers false for each missing op, so loading refuses a model that
//! needs one (naming it) and these bodies are never reached; reaching one is a bug.

use std::ops::Range;

use osprey_backend::{
    AttentionOps, AttnShape, DType, ExpertOps, ExpertPool, ExpertShape, Fence, GdnShape, HostExpert, Op, PagedView,
    Qwen4Ops, RecurrentOps, Result, Routing, Tensor,
};

use super::core::Form;
use super::{arg, u32_of, CudaBackend};
use crate::device::{Arg, LaunchConfig};

/// A missing op was called although `supports` refused it.
fn missing(op: Op) -> ! {
    panic!("the CUDA backend has no kernel for {op:?} yet and said so (supports is false): this is a bug")
}

impl AttentionOps for CudaBackend {
    fn attention_paged(
        &self,
        _: &Tensor,
        _: Range<usize>,
        _: PagedView<'_>,
        _: usize,
        _: AttnShape,
        _: f32,
        _: &mut Tensor,
    ) {
        missing(Op::AttentionPaged)
    }

    fn attention_bidirectional(
        &self,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: Range<usize>,
        _: AttnShape,
        _: f32,
        _: &mut Tensor,
    ) {
        missing(Op::AttentionBidirectional)
    }
}

impl RecurrentOps for CudaBackend {
    fn causal_conv_silu(&self, _: &Tensor, _: Range<usize>, _: &Tensor, _: usize, _: &mut Tensor) -> Result<Tensor> {
        missing(Op::GatedDeltaNet)
    }

    fn delta_gates(&self, _: &Tensor, _: &Tensor, _: Range<usize>, _: &Tensor, _: &Tensor) -> Result<(Tensor, Tensor)> {
        missing(Op::GatedDeltaNet)
    }

    fn gated_delta(
        &self,
        _: GdnShape,
        _: bool,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &mut Tensor,
    ) -> Result<Tensor> {
        missing(Op::GatedDeltaNet)
    }
}

impl ExpertOps for CudaBackend {
    fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing> {
        let (rows, experts) = (logits.rows(), logits.cols());
        let ids = self.empty(DType::I32, &[rows, k])?;
        let weights = self.empty(DType::F32, &[rows, k])?;
        let args = [
            arg(logits),
            arg(&ids),
            arg(&weights),
            u32_of(rows),
            u32_of(experts),
            u32_of(k),
            Arg::I32(i32::from(renorm)),
        ];
        let cfg = LaunchConfig { grid: [rows.div_ceil(64).max(1) as u32, 1, 1], block: [64, 1, 1] };
        self.try_run("route_topk", cfg, &args)?;
        Ok(Routing { ids, weights })
    }

    fn alloc_expert_pool(&self, _: u32, _: usize, _: ExpertShape) -> Result<ExpertPool> {
        missing(Op::ExpertSlots)
    }

    fn upload_expert(&self, _: &mut ExpertPool, _: usize, _: HostExpert) -> Result<Fence> {
        missing(Op::ExpertSlots)
    }

    fn moe_routed(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: &ExpertPool, _: &mut Tensor) -> Result<()> {
        missing(Op::ExpertSlots)
    }

    fn moe_combine(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        missing(Op::ExpertSlots)
    }
}

impl Qwen4Ops for CudaBackend {
    fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32) {
        self.rms(x, w, group, eps, Form::OnePlus);
    }

    fn silu(&self, x: &mut Tensor) {
        self.each("activate_f32", x, &[u32_of(x.numel()), Arg::I32(0)]);
    }

    fn sigmoid(&self, x: &mut Tensor) {
        self.each("activate_f32", x, &[u32_of(x.numel()), Arg::I32(1)]);
    }

    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        self.rms(x, w, w.numel(), eps, Form::Sigmoid(z));
    }

    fn hc_combine(&self, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        missing(Op::HyperConnections)
    }

    fn hc_inject(&self, _: &mut Tensor, _: &Tensor, _: &Tensor, _: usize) {
        missing(Op::HyperConnections)
    }

    fn ple_gate(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        missing(Op::Ple)
    }

    fn causal_conv_dilated_silu(&self, _: &Tensor, _: &Tensor, _: usize, _: usize, _: &mut Tensor) -> Result<Tensor> {
        missing(Op::Ple)
    }

    fn mean_rows(&self, _: &Tensor, _: Range<usize>) -> Result<Tensor> {
        missing(Op::AttentionSelected)
    }

    fn qsa_select(
        &self,
        _: &Tensor,
        _: Range<usize>,
        _: &Tensor,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: f32,
    ) -> Result<Tensor> {
        missing(Op::AttentionSelected)
    }

    fn attention_selected(
        &self,
        _: &Tensor,
        _: Range<usize>,
        _: PagedView<'_>,
        _: &Tensor,
        _: (usize, usize),
        _: AttnShape,
        _: f32,
        _: &mut Tensor,
    ) {
        missing(Op::AttentionSelected)
    }
}
