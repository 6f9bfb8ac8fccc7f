//! The batched forward: any mix of prefill chunks and decode tokens from several sequences in one call.

use osprey_kernels::norm::rms_norm_1p;

use super::state::{HybridState, LayerState};
use super::{Ffn, Mixer, Qwen35};
use crate::error::{Error, Result};
use crate::family::{ForwardOptions, ForwardOutput, LogitsWanted, Positions, SeqStep};
use crate::kv::PageTable;
use crate::layers::attention::RopeTables;
use crate::layers::gdn::LinearState;
use crate::layers::{linear, Segment};

impl Qwen35 {
    fn check(&self, steps: &[SeqStep<'_, '_>]) -> Result<()> {
        let h = self.cfg.hidden_size;
        for s in steps {
            if s.state.family::<HybridState>().map(|f| f.layers.len()) != Some(self.layers.len()) {
                return Err(Error::InvalidInput("a sequence state of another model".into()));
            }
        }
        for s in steps {
            let n = s.input.tokens.len();
            if let Some(&t) = s.input.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                return Err(Error::InvalidInput(format!(
                    "token id {t} is outside the vocabulary ({})",
                    self.cfg.vocab_size
                )));
            }
            if let Positions::Explicit(p) = s.input.positions {
                if p.len() != n {
                    return Err(Error::InvalidInput(format!("{} positions for {n} tokens", p.len())));
                }
            }
            for inj in s.input.injected {
                if inj.rows.len() % h != 0 || inj.offset + inj.rows.len() / h > n {
                    return Err(Error::InvalidInput("injected rows do not fit the chunk".into()));
                }
            }
        }
        Ok(())
    }

    /// Runs one step for a batch of sequences (the seam's `forward_with`). Each state advances by its tokens.
    pub(crate) fn run(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput> {
        self.check(steps)?;
        if steps.is_empty() {
            return Ok(ForwardOutput::default());
        }
        // KV slots for the new tokens (a pooled table was reserved by its pool; an unpooled one grows).
        for s in steps.iter_mut() {
            let need = s.state.len + s.input.tokens.len();
            s.state.kv.grow(need).map_err(Error::InvalidInput)?;
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
        // 1. Segments, embeddings (with injected rows) and positions of the whole batch.
        let mut segs = Vec::with_capacity(steps.len());
        let mut positions: Vec<[i64; 3]> = Vec::new();
        let mut x: Vec<f32> = Vec::new();
        for s in steps.iter() {
            let row = segs.iter().map(|g: &Segment| g.len).sum();
            let (past, n) = (s.state.len, s.input.tokens.len());
            segs.push(Segment { row, len: n, past });
            let base = x.len();
            x.resize(base + n * h, 0.0);
            for (i, &t) in s.input.tokens.iter().enumerate() {
                self.embed.row_f32(t as usize, &mut x[base + i * h..base + (i + 1) * h]);
            }
            for inj in s.input.injected {
                let at = base + inj.offset * h;
                x[at..at + inj.rows.len()].copy_from_slice(inj.rows);
            }
            match s.input.positions {
                Positions::Text => positions.extend((0..n).map(|i| [(past + i) as i64 + s.state.rope_delta; 3])),
                Positions::Explicit(p) => positions.extend_from_slice(p),
            }
        }
        let t = positions.len();
        let rope = RopeTables::new(&self.rope, &positions);
        let mut hidden = Vec::new();
        if capture_hidden {
            hidden.push(x.clone());
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
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(t) = opts.teacher_inputs {
                x.copy_from_slice(&t[li]);
            }
            let mut hn = x.clone();
            rms_norm_1p(&mut hn, &layer.input_norm, eps);
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
                    g.forward(&hn, &segs, &mut st)
                }
                Mixer::Full(a) => {
                    let kv_layer = match parts.first().map(|(_, f)| &f.layers[li]) {
                        Some(LayerState::Full { kv_layer }) => *kv_layer,
                        _ => unreachable!("state built for another layer stack: this is a bug"),
                    };
                    let mut tables: Vec<&mut PageTable> = parts.iter_mut().map(|(t, _)| &mut **t).collect();
                    a.forward(&hn, &segs, (&mut tables, kv_layer), &rope, &self.rope)
                }
            };
            x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
            let mut hn = x.clone();
            rms_norm_1p(&mut hn, &layer.post_norm, eps);
            let ffn = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&hn, t),
                Ffn::Moe(m) => {
                    let src = self.experts.as_deref().expect("MoE model without an expert source: this is a bug");
                    m.forward(&hn, src)?
                }
            };
            x.iter_mut().zip(&ffn).for_each(|(a, b)| *a += b);
            if capture_hidden && li + 1 < self.layers.len() {
                hidden.push(x.clone());
            }
        }
        drop(parts);
        // 3. Final norm and lm_head on the rows whose logits are wanted.
        if capture_hidden {
            let mut normed = x.clone();
            rms_norm_1p(&mut normed, &self.norm, eps);
            hidden.push(normed);
        }
        let mut logits = Vec::with_capacity(steps.len());
        for (s, seg) in steps.iter_mut().zip(&segs) {
            let rows = match s.input.logits {
                LogitsWanted::None => 0..0,
                LogitsWanted::Last => seg.row + seg.len.saturating_sub(1)..seg.row + seg.len,
                LogitsWanted::All => seg.row..seg.row + seg.len,
            };
            let mut sel = x[rows.start * h..rows.end * h].to_vec();
            rms_norm_1p(&mut sel, &self.norm, eps);
            logits.push(linear(&sel, rows.len(), &self.lm_head));
            s.state.len += seg.len;
        }
        Ok(ForwardOutput { logits, hidden })
    }
}
