//! How a device's memory is split when a model loads on it (`--device cuda:N`, `cuda-emu`): the dense
//! weights (everything but routed experts: they stay in host RAM or on disk), the KV pool at its full
//! capacity, a reserve for activations and scratch, and what is left as expert slots, the same number
//! in every MoE layer (docs/cuda.md). A host backend reports no device memory and gets no plan: its
//! experts are read where they lie.

use anyhow::{bail, Result};
use osprey_models::config::LayerKind;
use osprey_models::{Checkpoint, ModelConfig};

/// Activations and scratch: 512 MiB plus 5% of the device (a 2,048-token prefill chunk of the largest
/// served model needs about 0.5 GiB: GPU.md's budget).
fn reserve(total: u64) -> u64 {
    (512 << 20) + total / 20
}

/// The split of one device's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Device memory.
    pub total: u64,
    /// Dense weights (and the vision tower's).
    pub dense: u64,
    /// The KV pool at capacity.
    pub kv: u64,
    /// Activations and scratch.
    pub reserve: u64,
    /// Bytes of one routed expert (0: a dense model).
    pub expert_bytes: u64,
    /// MoE layers.
    pub moe_layers: usize,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Expert slots per MoE layer (`num_experts` when every expert fits).
    pub slots_per_layer: usize,
}

impl MemoryPlan {
    /// Splits `total` bytes: `dense` and `kv` first, then the reserve, then as many slots per layer as
    /// fit, at most every expert. An error names what does not fit.
    pub fn new(total: u64, dense: u64, kv: u64, experts: (u64, usize, usize)) -> Result<Self> {
        let (expert_bytes, moe_layers, num_experts) = experts;
        let reserve = reserve(total);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let Some(left) = total.checked_sub(dense + kv + reserve) else {
            bail!(
                "the dense weights ({:.2} GiB), the KV pool ({:.2} GiB) and the activation reserve ({:.2} GiB) \
                 do not fit in {:.2} GiB of device memory: lower --kv-capacity-tokens, or use --device cpu",
                gib(dense),
                gib(kv),
                gib(reserve),
                gib(total)
            );
        };
        let per_slot = expert_bytes * moe_layers as u64;
        let slots = left.checked_div(per_slot).map_or(num_experts, |n| (n as usize).min(num_experts));
        if num_experts > 0 && slots == 0 {
            bail!(
                "after the dense weights and the KV pool, {:.2} GiB is left: not one expert slot per layer \
                 ({:.2} GiB) fits; lower --kv-capacity-tokens, or use --device cpu",
                gib(left),
                gib(per_slot)
            );
        }
        Ok(MemoryPlan { total, dense, kv, reserve, expert_bytes, moe_layers, num_experts, slots_per_layer: slots })
    }

    /// The plan of `cfg`'s checkpoint on `total` bytes of device memory, with `kv_tokens` of KV at
    /// `kv_elem` bytes per element.
    pub fn for_model(total: u64, cfg: &ModelConfig, ck: &Checkpoint, kv_tokens: usize, kv_elem: usize) -> Result<Self> {
        // Routed experts are every tensor under `.experts.` (the Hub's per-expert and fused layouts alike).
        let (mut dense, mut experts) = (0u64, 0u64);
        for name in ck.names() {
            let bytes = ck.raw(name)?.1.len() as u64;
            if name.contains(".experts.") {
                experts += bytes;
            } else {
                dense += bytes;
            }
        }
        let text = &cfg.text;
        let kinds = text.layer_kinds()?;
        let kv_layers = kinds.iter().filter(|k| !matches!(k, LayerKind::Linear)).count();
        let kv = (kv_tokens * 2 * kv_layers * text.num_key_value_heads * text.head_dim() * kv_elem) as u64;
        let (moe_layers, num_experts) = match text.moe()? {
            Some(m) => (kinds.len(), m.num_experts),
            None => (0, 0),
        };
        let expert_bytes = if moe_layers * num_experts == 0 { 0 } else { experts / (moe_layers * num_experts) as u64 };
        MemoryPlan::new(total, dense, kv, (expert_bytes, moe_layers, num_experts))
    }

    /// One line for the startup log.
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "device memory {:.2} GiB: dense weights {:.2}, KV {:.2}, reserve {:.2}, expert slots {} of {} per layer \
             ({:.2} GiB)",
            gib(self.total),
            gib(self.dense),
            gib(self.kv),
            gib(self.reserve),
            self.slots_per_layer,
            self.num_experts,
            gib(self.expert_bytes * (self.slots_per_layer * self.moe_layers) as u64)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::MemoryPlan;

    const GIB: u64 = 1 << 30;
    /// GPU.md's Qwen3.5-35B-A3B: 40 MoE layers of 256 experts of 1.6875 MiB (NVFP4).
    const EXPERT: u64 = 1_769_472;

    #[test]
    fn slots_take_what_the_dense_weights_the_kv_pool_and_the_reserve_leave() {
        // A 24 GiB card, NVFP4 dense weights ~3.4 GiB, 32k tokens of bf16 KV (0.625 GiB): every expert fits.
        let p = MemoryPlan::new(24 * GIB, 3_650_000_000, 671_088_640, (EXPERT, 40, 256)).expect("fits");
        assert_eq!(p.slots_per_layer, 256);
        // A 16 GiB card: GPU.md's estimate is about two thirds of the experts.
        let p = MemoryPlan::new(16 * GIB, 3_650_000_000, 671_088_640, (EXPERT, 40, 256)).expect("fits");
        let left = 16 * GIB - 3_650_000_000 - 671_088_640 - ((512 << 20) + 16 * GIB / 20);
        assert_eq!(p.slots_per_layer as u64, left / (EXPERT * 40));
        assert!((150..200).contains(&p.slots_per_layer), "{}", p.slots_per_layer);
        // A dense model: no slots to plan.
        let d = MemoryPlan::new(8 * GIB, GIB, GIB, (0, 0, 0)).expect("fits");
        assert_eq!(d.slots_per_layer, 0);
    }

    /// Issue 51, item 7: Qwen3.5-35B-A3B with its vision tower on a 24 GiB card, a 64k-token image
    /// conversation in bf16 KV, experts in host RAM beyond the slots: every part named in bytes, and score
    /// scratch inside the reserve because it is banded (unbanded it would not be). Causal attention over
    /// the pages stores no score since issue 52 (flash attention; its partial sums stay under 4 MiB,
    /// `flash_attention_memory_does_not_grow_with_the_context`); the band cap still holds bidirectional
    /// attention's rows, whose `n × n` grows the same way with a long run of image rows.
    #[test]
    fn qwen35_35b_a3b_with_a_64k_image_context_on_24_gib() {
        // 40 layers, every 4th full attention: 10 KV layers of 2 heads × 256, K and V, bf16, 65,536 tokens.
        let kv = 65_536 * 2 * 10 * 2 * 256 * 2;
        assert_eq!(kv, 1_342_177_280, "1.25 GiB of KV");
        // NVFP4 text weights outside the experts (GPU.md) and the bf16 vision tower (~0.43 B parameters).
        let (text, vision) = (3_650_000_000u64, 860_000_000u64);
        let p = MemoryPlan::new(24 * GIB, text + vision, kv, (EXPERT, 40, 256)).expect("fits");
        assert_eq!(p.reserve, (512 << 20) + 24 * GIB / 20, "0.5 GiB + 5%: 1.70 GiB");
        let left = 24 * GIB - (text + vision) - kv - p.reserve;
        assert_eq!(p.slots_per_layer as u64, left / (EXPERT * 40));
        assert_eq!(p.slots_per_layer, 255, "one expert a layer stays in host RAM (streamed when routed to)");
        assert_eq!(
            p.describe(),
            "device memory 24.00 GiB: dense weights 4.20, KV 1.25, reserve 1.70, expert slots 255 of 256 per layer \
             (16.81 GiB)"
        );
        // Rows of 16 heads × 65,536 keys of f32 scores are 4 MiB each (a 512-token chunk's paged attention
        // before flash attention, or bidirectional rows that long): 512 of them would need 2 GiB, more
        // than the whole reserve; in bands they hold at most the cap.
        let row = 16 * 65_536 * 4u64;
        assert!(512 * row > p.reserve, "unbanded, the scores alone would not fit");
        let band = (osprey_backend_cuda::SCRATCH_CAP as u64 / row).max(1);
        assert_eq!((band, band * row), (16, 64 << 20));
        assert!(band * row < p.reserve / 16, "banded, a small part of the reserve");
    }

    #[test]
    fn what_does_not_fit_is_named() {
        let e = MemoryPlan::new(4 * GIB, 3 * GIB, GIB, (EXPERT, 40, 256)).expect_err("dense + KV over").to_string();
        assert!(e.contains("--kv-capacity-tokens") && e.contains("4.00 GiB"), "{e}");
        let total = 2 * GIB;
        let tight = total - (512 << 20) - total / 20 - 10;
        let e = MemoryPlan::new(total, tight, 0, (EXPERT, 40, 256)).expect_err("no slot").to_string();
        assert!(e.contains("not one expert slot"), "{e}");
    }
}
