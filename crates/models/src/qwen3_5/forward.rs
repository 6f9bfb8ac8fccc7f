//! The batched forward: any mix of prefill chunks and decode tokens from several sequences in one call.

use super::state::{HybridState, LayerState};
use super::{DecoderLayer, Ffn, Mixer, Qwen35};
use crate::error::{Error, Result};
use crate::family::{ForwardOptions, ForwardOutput, SeqStep};
use crate::kv::PageTable;
use crate::layers::batch;
use crate::layers::gdn::LinearState;

impl Qwen35 {
    fn check(&self, steps: &[SeqStep<'_, '_>]) -> Result<()> {
        let h = self.cfg.hidden_size;
        for s in steps {
            if s.state.family::<HybridState>().map(|f| f.layers.len()) != Some(self.layers.len()) {
                return Err(Error::Engine("a sequence state of another model".into()));
            }
        }
        batch::check_inputs(steps, self.cfg.vocab_size, h)
    }

    /// A layer's dense MLP or MoE block on its normed input.
    pub(super) fn ffn(&self, layer: &DecoderLayer, hn: &osprey_backend::Tensor) -> Result<osprey_backend::Tensor> {
        let b = self.backend.as_ref();
        match &layer.ffn {
            Ffn::Dense(m) => m.forward(b, hn),
            Ffn::Moe(m) => {
                let src = self.experts.as_deref().expect("MoE model without an expert source: this is a bug");
                m.forward(b, hn, src)
            }
        }
    }

    /// Runs one step for a batch of sequences (the seam's `forward_with`). Each state advances by its tokens.
    pub(crate) fn run(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput> {
        self.check(steps)?;
        if steps.is_empty() {
            return Ok(ForwardOutput::default());
        }
        let b = self.backend.as_ref();
        // KV slots for the new tokens (a pooled table was reserved by its pool; an unpooled one grows), the
        // pages they land in private, the page ids on the backend.
        for s in steps.iter_mut() {
            let need = s.state.len + s.input.tokens.len();
            s.state.kv.grow(s.state.len, need, b)?;
        }
        let capture_hidden = opts.capture_hidden || opts.teacher_inputs.is_some();
        if let Some(t) = opts.teacher_inputs {
            let rows: usize = steps.iter().map(|s| s.input.tokens.len()).sum();
            if t.len() != self.layers.len() || t.iter().any(|x| x.len() != rows * self.cfg.hidden_size) {
                return Err(Error::InvalidInput("teacher inputs must be one [T, hidden] matrix per layer".into()));
            }
        }
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps as f32;
        // 1. Segments, embeddings (with injected rows) and positions of the whole batch: the host sends
        //    token ids, positions and media rows; everything after stays on the backend.
        let l = batch::layout(steps);
        let mut x = batch::embed(b, &self.embed, steps, &l, h)?;
        let (segs, ids, positions) = (l.segs, l.ids, l.positions);
        let rope = b.rope_table(&self.rope, &positions)?;
        let mut hidden = Vec::new();
        if capture_hidden {
            hidden.push(b.download_f32(&x)?);
        }
        // 2. Decoder layers: x += mixer(norm(x)); x += ffn(norm(x)). Each sequence's page table and this
        //    family's state, borrowed apart.
        let mut parts: Vec<(&mut PageTable, &mut HybridState)> = steps
            .iter_mut()
            .map(|s| {
                let st = &mut *s.state;
                let family: &mut dyn std::any::Any = st.family.as_mut();
                let family = family.downcast_mut::<HybridState>().expect("checked before the forward: this is a bug");
                (&mut st.kv, family)
            })
            .collect();
        // The last layer's FFN output, added where the next input norm reads `x` (`norm_after`).
        let mut ffn_out: Option<osprey_backend::Tensor> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(t) = opts.teacher_inputs {
                x = b.upload_f32(&t[li], &[ids.len(), h])?;
            }
            let hn = norm_after(b, &mut x, ffn_out.take(), &layer.input_norm, eps)?;
            let mixed = match &layer.mixer {
                Mixer::Linear(g) => {
                    let mut st: Vec<&mut LinearState> = parts
                        .iter_mut()
                        .map(|(_, f)| match &mut f.layers[li] {
                            LayerState::Linear(l) => l,
                            LayerState::Full { .. } => {
                                unreachable!("state built for another layer stack: this is a bug")
                            }
                        })
                        .collect();
                    g.forward(b, &hn, &segs, &mut st, opts.verify)?
                }
                Mixer::Full(a) => {
                    let kv_layer = match parts.first().map(|(_, f)| &f.layers[li]) {
                        Some(LayerState::Full { kv_layer }) => *kv_layer,
                        _ => unreachable!("state built for another layer stack: this is a bug"),
                    };
                    let mut tables: Vec<&mut PageTable> = parts.iter_mut().map(|(t, _)| &mut **t).collect();
                    a.forward(b, &hn, &segs, (&mut tables, kv_layer), (&rope, &self.rope))?
                }
            };
            let hn = b.add_rms_norm(&mut x, &mixed, &layer.post_norm, eps, true)?;
            let f = self.ffn(layer, &hn)?;
            if capture_hidden && li + 1 < self.layers.len() {
                b.add(&mut x, &f);
                hidden.push(b.download_f32(&x)?);
            } else {
                ffn_out = Some(f);
            }
        }
        ffn_out.iter().for_each(|f| b.add(&mut x, f)); // the last layer's
        drop(parts);
        // 3. Final norm and lm_head on the rows whose logits are wanted; only those logits come back.
        let last_hidden = if capture_hidden || opts.keep_hidden {
            let mut normed = x.clone();
            b.rms_norm(&mut normed, &self.norm, eps, true);
            if capture_hidden {
                hidden.push(b.download_f32(&normed)?);
            }
            opts.keep_hidden.then_some(normed)
        } else {
            None
        };
        let (logits, sampled) = batch::logits(b, steps, &segs, |rows| {
            let mut sel = b.gather_rows(&x, rows)?;
            b.rms_norm(&mut sel, &self.norm, eps, true);
            Ok(b.linear(&sel, &self.lm_head)?)
        })?;
        Ok(ForwardOutput { logits, sampled, hidden, last_hidden })
    }
}

/// A layer's input norm of `x`; with the last layer's FFN output pending, the residual add and the norm
/// in one op (`add_rms_norm`: one launch on a device), otherwise a copy normed. Hidden states captured
/// between layers add the FFN output at once instead (they read `x` whole).
fn norm_after(
    b: &dyn osprey_backend::Backend,
    x: &mut osprey_backend::Tensor,
    pending: Option<osprey_backend::Tensor>,
    w: &osprey_backend::Tensor,
    eps: f32,
) -> Result<osprey_backend::Tensor> {
    Ok(match pending {
        Some(f) => b.add_rms_norm(x, &f, w, eps, true)?,
        None => {
            let mut hn = x.clone();
            b.rms_norm(&mut hn, w, eps, true);
            hn
        }
    })
}
