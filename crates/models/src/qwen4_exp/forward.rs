//! The batched forward of `qwen4_exp`: any mix of prefill chunks and decode tokens from several
//! sequences in one call, as Qwen3.5's, with the residual carried as `hc` streams.

use super::state::{Mix, Qwen4State};
use super::{Mixer, Qwen4Exp};
use crate::error::{Error, Result};
use crate::family::{ForwardOptions, ForwardOutput, SeqStep};
use crate::kv::PageTable;
use crate::layers::batch;
use crate::layers::gdn::LinearState;
use crate::layers::Segment;
use osprey_backend::{RopeTable, Tensor};

impl Qwen4Exp {
    fn check(&self, steps: &[SeqStep<'_, '_>]) -> Result<()> {
        for s in steps {
            if s.state.family::<Qwen4State>().map(|f| f.layers.len()) != Some(self.layers.len()) {
                return Err(Error::Engine("a sequence state of another model".into()));
            }
        }
        batch::check_inputs(steps, self.vocab, self.hidden)
    }

    /// One step for a batch of sequences; each state advances by its tokens.
    pub(crate) fn run(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput> {
        self.check(steps)?;
        if steps.is_empty() {
            return Ok(ForwardOutput::default());
        }
        if opts.teacher_inputs.is_some() {
            return Err(Error::Unsupported("teacher inputs for qwen4_exp".into()));
        }
        let b = self.backend.as_ref();
        let (h, hc) = (self.hidden, self.p.hc);
        for s in steps.iter_mut() {
            let need = s.state.len + s.input.tokens.len();
            s.state.kv.grow(s.state.len, need, b)?;
        }
        // 1. Segments, embeddings (with injected media rows), positions; the streams start as hc copies.
        let l = batch::layout(steps);
        let e = batch::embed(b, &self.embed, steps, &l, h)?;
        let (segs, ids, positions) = (l.segs, l.ids, l.positions);
        let n = ids.len();
        let mut x = b.zeros_f32(&[n, hc * h])?;
        b.hc_inject(&mut x, &e, &b.upload_f32(&vec![1.0; n * hc], &[n, hc])?, hc);
        let rope = b.rope_table(&self.rope, &positions)?;
        let mut hidden = Vec::new();
        if opts.capture_hidden {
            hidden.push(b.download_f32(&x)?);
        }
        let mut parts: Vec<(&mut PageTable, &mut Qwen4State)> = steps
            .iter_mut()
            .map(|s| {
                let st = &mut *s.state;
                let family: &mut dyn std::any::Any = st.family.as_mut();
                let family = family.downcast_mut::<Qwen4State>().expect("checked before the forward: this is a bug");
                (&mut st.kv, family)
            })
            .collect();
        // 2. The n-gram rows of every PLE layer (from each sequence's token history), and the position
        //    histories the indexers rope their blocks with.
        let ple_rows = self.ple_rows(&mut parts, &segs, &ids, &positions);
        // 3. Layers: PLE into the streams; then attention / Gated DeltaNet and the MoE, each entered and
        //    injected through its hyper-connection.
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(ple) = &layer.ple {
                let mut st: Vec<_> =
                    parts.iter_mut().map(|(_, f)| f.layers[li].ple.as_mut().expect("PLE state: a bug")).collect();
                let add = ple.forward(b, &x, &ple_rows[li], &segs, &mut st)?;
                b.add(&mut x, &add);
            }
            let (input, inj) = layer.attn_hc.enter(b, &x)?;
            let mixed = self.mix(li, &layer.mixer, &input, (&segs, &rope), &mut parts)?;
            b.hc_inject(&mut x, &mixed, inj.as_ref().expect("a layer's hyper-connection injects"), hc);
            let (input, inj) = layer.mlp_hc.enter(b, &x)?;
            let ffn = layer.moe.forward(b, &input, self.experts.as_ref())?;
            b.hc_inject(&mut x, &ffn, inj.as_ref().expect("a layer's hyper-connection injects"), hc);
            if opts.capture_hidden && li + 1 < self.layers.len() {
                hidden.push(b.download_f32(&x)?);
            }
        }
        drop(parts);
        // 4. The final mixer (no norm) and lm_head on the rows whose logits are wanted.
        let (out, _) = self.mixer.enter(b, &x)?;
        if opts.capture_hidden {
            hidden.push(b.download_f32(&out)?);
        }
        let (logits, sampled) =
            batch::logits(b, steps, &segs, |rows| Ok(b.linear(&b.gather_rows(&out, rows)?, &self.lm_head)?))?;
        Ok(ForwardOutput { logits, sampled, hidden, last_hidden: None })
    }
    /// A layer's token mixer on `input`: Gated DeltaNet, or the indexer's block selection then attention
    /// over the selected blocks.
    fn mix(
        &self,
        li: usize,
        mixer: &Mixer,
        input: &Tensor,
        (segs, rope): (&[Segment], &RopeTable),
        parts: &mut [(&mut PageTable, &mut Qwen4State)],
    ) -> Result<Tensor> {
        let b = self.backend.as_ref();
        Ok(match mixer {
            Mixer::Linear(g) => {
                let mut st: Vec<&mut LinearState> = parts
                    .iter_mut()
                    .map(|(_, f)| match &mut f.layers[li].mix {
                        Mix::Linear(l) => l,
                        Mix::Indexed { .. } => unreachable!("state built for another layer stack: a bug"),
                    })
                    .collect();
                g.forward(b, input, segs, &mut st, &[])?
            }
            Mixer::Indexed(attn, indexer) => {
                let kv_layer = match parts.first().map(|(_, f)| &f.layers[li].mix) {
                    Some(Mix::Indexed { kv_layer, .. }) => *kv_layer,
                    _ => unreachable!("state built for another layer stack: a bug"),
                };
                let selected = {
                    let (hist, mut st): (Vec<&[[i64; 3]]>, Vec<_>) = parts
                        .iter_mut()
                        .map(|(_, f)| {
                            let f = &mut **f;
                            match &mut f.layers[li].mix {
                                Mix::Indexed { indexer, .. } => (&f.positions[..], indexer),
                                Mix::Linear(_) => unreachable!("state built for another layer stack: a bug"),
                            }
                        })
                        .unzip();
                    indexer.select(b, input, segs, rope, &hist, &mut st)?
                };
                let mut tables: Vec<&mut PageTable> = parts.iter_mut().map(|(t, _)| &mut **t).collect();
                attn.forward_selected(
                    b,
                    input,
                    segs,
                    (&mut tables, kv_layer),
                    (rope, &self.rope),
                    Some((&selected, indexer.ratio())),
                )?
            }
        })
    }

    /// The n-gram rows of every PLE layer (from each sequence's token history, before this step's tokens
    /// join it), then each sequence's position and token histories advanced.
    fn ple_rows(
        &self,
        parts: &mut [(&mut PageTable, &mut Qwen4State)],
        segs: &[Segment],
        ids: &[u32],
        positions: &[[i64; 3]],
    ) -> Vec<Vec<u32>> {
        let mut ple_rows: Vec<Vec<u32>> = vec![Vec::new(); self.layers.len()];
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(ple) = &layer.ple {
                for ((_, f), seg) in parts.iter().zip(segs) {
                    ple_rows[li].extend(ple.hasher.row_ids(&f.history, &ids[seg.row..seg.row + seg.len]));
                }
            }
        }
        for ((_, f), seg) in parts.iter_mut().zip(segs) {
            f.positions.extend_from_slice(&positions[seg.row..seg.row + seg.len]);
            let ctx = f.history.len();
            f.history.extend_from_slice(&ids[seg.row..seg.row + seg.len]);
            let drop = f.history.len() - ctx;
            f.history.drain(..drop);
        }
        ple_rows
    }
}
