//! The multi-token-prediction head Qwen3.5 / Qwen3.6 checkpoints ship (`mtp.*`, `mtp_num_hidden_layers`),
//! which transformers skips and vLLM / SGLang use as the draft model of speculative decoding. As their
//! `qwen3_5_mtp` describes it: the next token's embedding and the main model's final normed hidden
//! state, each normalised (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), joined by `fc` (`[2H] → [H]`,
//! embedding half first), one full-attention decoder layer of the family (dense MLP or MoE), the final
//! `norm`, and the main model's `lm_head`. The embedding is the main model's too. Reference:
//! `tools/gen_mtp_fixtures.py`; parity: `tests/mtp.rs`.
//!
//! `fc` is kept as its two column halves (two `[H, H]` linears summed): the seam has no column concat,
//! and the split is exact up to the order of one f32 sum.

use osprey_backend::{Backend, Tensor};

use super::{DecoderLayer, Mixer, Qwen35};
use crate::checkpoint::{Checkpoint, Weight};
use crate::config::{LayerKind, TextConfig};
use crate::error::{Error, Result};
use crate::family::{DraftOutput, DraftStep};
use crate::kv::PageTable;
use crate::layers::{batch, load_vector, place, stack_rows, Segment};

/// Where the head's routed experts live (its expert-layer index follows the decoder's).
pub(super) const MOE_PREFIX: &str = "mtp.layers.0.mlp";

/// The loaded head.
#[derive(Debug)]
pub(super) struct MtpHead {
    norm_embedding: Tensor,
    norm_hidden: Tensor,
    fc_embedding: Tensor,
    fc_hidden: Tensor,
    pub(super) layer: DecoderLayer,
    norm: Tensor,
    /// The page-table plane its K/V rows use (after the decoder's full-attention layers).
    kv_layer: usize,
}

impl MtpHead {
    /// The checkpoint's head, or `None` when it has none; `kv_layer` is its KV plane.
    pub(super) fn load(
        b: &dyn Backend,
        ck: &Checkpoint,
        c: &TextConfig,
        expert_slots: Option<usize>,
        kv_layer: usize,
    ) -> Result<Option<Self>> {
        if c.mtp_num_hidden_layers == 0 || !ck.contains("mtp.fc.weight") {
            return Ok(None);
        }
        if c.mtp_num_hidden_layers > 1 {
            return Err(Error::Unsupported(format!(
                "a draft head of {} layers (one is supported)",
                c.mtp_num_hidden_layers
            )));
        }
        let h = c.hidden_size;
        let fc = ck.linear("mtp.fc", h, 2 * h)?.to_f32();
        let half = |right: bool| -> Vec<f32> {
            fc.chunks_exact(2 * h).flat_map(|r| if right { &r[h..] } else { &r[..h] }).copied().collect()
        };
        let index = c.num_hidden_layers;
        Ok(Some(MtpHead {
            norm_embedding: load_vector(b, ck, "mtp.pre_fc_norm_embedding.weight", h)?,
            norm_hidden: load_vector(b, ck, "mtp.pre_fc_norm_hidden.weight", h)?,
            fc_embedding: place(b, Weight::from_f32(h, h, half(false)))?,
            fc_hidden: place(b, Weight::from_f32(h, h, half(true)))?,
            layer: DecoderLayer::load(b, ck, "mtp.layers.0", LayerKind::Full, index, c, expert_slots)?,
            norm: load_vector(b, ck, "mtp.norm.weight", h)?,
            kv_layer,
        }))
    }

    /// Runs the head over each step's entries (see [`DraftStep`]).
    pub(super) fn run(&self, m: &Qwen35, steps: &mut [DraftStep<'_, '_>], capture: bool) -> Result<DraftOutput> {
        let b = m.backend.as_ref();
        let (h, eps) = (m.cfg.hidden_size, m.cfg.rms_norm_eps as f32);
        // 1. The batch: segments, ids, positions, and every step's hidden rows in one tensor.
        let (mut segs, mut ids, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        for s in steps.iter() {
            let n = s.tokens.len();
            if n == 0 || s.hidden.rows() != n || s.hidden.cols() != h {
                return Err(Error::InvalidInput(format!("{n} draft entries with {} hidden rows", s.hidden.rows())));
            }
            batch::check_tokens(s.tokens, m.cfg.vocab_size)?;
            batch::check_positions(s.positions, n)?;
            segs.push(Segment { row: ids.len(), len: n, past: s.start });
            ids.extend_from_slice(s.tokens);
            batch::extend_positions(&mut positions, s.positions, s.start, n, s.state.rope_delta);
        }
        let mut hidden = stack_rows(b, &steps.iter().map(|s| &s.hidden).collect::<Vec<_>>(), h)?;
        for s in steps.iter_mut() {
            s.state.kv.grow(s.start, s.start + s.tokens.len(), b)?;
        }
        // 2. fc(norm(embedding) | norm(hidden)).
        let mut e = b.embed(&m.embed, &ids)?;
        b.rms_norm(&mut e, &self.norm_embedding, eps, true);
        b.rms_norm(&mut hidden, &self.norm_hidden, eps, true);
        let mut x = b.linear(&e, &self.fc_embedding)?;
        b.add(&mut x, &b.linear(&hidden, &self.fc_hidden)?);
        let mut captured = Vec::new();
        if capture {
            captured.push(b.download_f32(&x)?);
        }
        // 3. The decoder layer: x += attn(norm(x)); x += ffn(norm(x)), its K/V in the head's plane.
        let Mixer::Full(attn) = &self.layer.mixer else { unreachable!("the head's layer is full attention") };
        let rope = b.rope_table(&m.rope, &positions)?;
        let mut hn = x.clone();
        b.rms_norm(&mut hn, &self.layer.input_norm, eps, true);
        let mut tables: Vec<&mut PageTable> = steps.iter_mut().map(|s| &mut s.state.kv).collect();
        let mixed = attn.forward(b, &hn, &segs, (&mut tables, self.kv_layer), (&rope, &m.rope))?;
        let hn = b.add_rms_norm(&mut x, &mixed, &self.layer.post_norm, eps, true)?;
        b.add(&mut x, &m.ffn(&self.layer, &hn)?);
        if capture {
            captured.push(b.download_f32(&x)?);
        }
        // 4. Final norm; logits of each step's last entry.
        b.rms_norm(&mut x, &self.norm, eps, true);
        if capture {
            captured.push(b.download_f32(&x)?);
            captured.push(b.download_f32(&b.linear(&x, &m.lm_head)?)?);
        }
        let last: Vec<usize> = segs.iter().map(|s| s.row + s.len - 1).collect();
        let out = b.gather_rows(&x, &last)?;
        let logits = b.download_f32(&b.linear(&out, &m.lm_head)?)?;
        let v = m.cfg.vocab_size;
        Ok(DraftOutput {
            logits: logits.chunks_exact(v).map(<[f32]>::to_vec).collect(),
            hidden: (0..last.len()).map(|i| b.gather_rows(&out, &[i])).collect::<std::result::Result<_, _>>()?,
            captured,
        })
    }
}
