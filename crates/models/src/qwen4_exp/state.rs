//! `qwen4_exp`'s per-sequence state: per layer the Gated DeltaNet state or the KV plane and QSA keys,
//! the PLE conv state where the layer has PLE; per sequence the n-gram token history and the position
//! history the indexers rope blocks with. A snapshot is the whole of it (KV rows stay in pages), so a
//! prefix-cache hit resumes PLE, n-grams and the indexers exactly.

use std::any::Any;

use osprey_backend::{Backend, HostTensor, Tensor};

use super::qsa::{HostIndexerState, IndexerState};
use crate::error::{Error, Result};
use crate::layers::gdn::{HostLinearState, LinearState};
use crate::state::{FamilySnapshot, FamilyState};

#[derive(Clone, Debug)]
pub(crate) enum Mix {
    Linear(LinearState),
    Indexed { kv_layer: usize, indexer: IndexerState },
}

#[derive(Clone, Debug)]
pub(crate) struct LayerState {
    pub(crate) mix: Mix,
    /// The PLE conv's last inputs, for a layer with PLE.
    pub(crate) ple: Option<Tensor>,
}

#[derive(Clone, Debug)]
pub(crate) struct Qwen4State {
    pub(crate) layers: Vec<LayerState>,
    /// The last `ngram_size − 1` tokens fed (EOS before the first).
    pub(crate) history: Vec<u32>,
    /// The mRoPE position of every token fed.
    pub(crate) positions: Vec<[i64; 3]>,
}

/// A layer's state in host memory.
#[derive(Clone, Debug)]
enum HostMix {
    Linear(HostLinearState),
    Indexed(HostIndexerState),
}

/// [`Qwen4State`] in host memory (a snapshot): the device tensors downloaded, the rest copied.
#[derive(Clone, Debug)]
struct Qwen4Snapshot {
    layers: Vec<(HostMix, Option<HostTensor>)>,
    history: Vec<u32>,
    positions: Vec<[i64; 3]>,
}

impl FamilySnapshot for Qwen4Snapshot {
    fn bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|(mix, ple)| {
                let mix = match mix {
                    HostMix::Linear(s) => s.bytes(),
                    HostMix::Indexed(i) => i.bytes(),
                };
                mix + ple.as_ref().map_or(0, HostTensor::bytes)
            })
            .sum();
        layers + 4 * self.history.len() + 24 * self.positions.len()
    }
}

impl FamilyState for Qwen4State {
    fn bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let mix = match &l.mix {
                    Mix::Linear(s) => s.bytes(),
                    Mix::Indexed { indexer, .. } => indexer.bytes(),
                };
                mix + l.ple.as_ref().map_or(0, Tensor::bytes)
            })
            .sum();
        layers + 4 * self.history.len() + 24 * self.positions.len()
    }

    fn snapshot(&self, b: &dyn Backend) -> Result<Box<dyn FamilySnapshot>> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mix = match &l.mix {
                    Mix::Linear(s) => HostMix::Linear(s.to_host(b)?),
                    Mix::Indexed { indexer, .. } => HostMix::Indexed(indexer.to_host(b)?),
                };
                Ok((mix, l.ple.as_ref().map(|t| b.download_host(t)).transpose()?))
            })
            .collect::<Result<_>>()?;
        Ok(Box::new(Qwen4Snapshot { layers, history: self.history.clone(), positions: self.positions.clone() }))
    }

    fn restore(&mut self, snap: &dyn FamilySnapshot, b: &dyn Backend) -> Result<()> {
        let any: &dyn Any = snap;
        let snap = any
            .downcast_ref::<Qwen4Snapshot>()
            .ok_or_else(|| Error::Engine("snapshot belongs to another model family".into()))?;
        if snap.layers.len() != self.layers.len() {
            return Err(Error::Engine("snapshot belongs to another model".into()));
        }
        for (l, (mix, ple)) in self.layers.iter_mut().zip(&snap.layers) {
            match (&mut l.mix, mix) {
                (Mix::Linear(s), HostMix::Linear(h)) => s.restore(h, b)?,
                (Mix::Indexed { indexer, .. }, HostMix::Indexed(h)) => indexer.restore(h, b)?,
                _ => return Err(Error::Engine("snapshot belongs to another model".into())),
            }
            l.ple = ple.as_ref().map(|h| b.upload_host(h)).transpose()?;
        }
        self.history.clone_from(&snap.history);
        self.positions.clone_from(&snap.positions);
        Ok(())
    }

    fn boxed_clone(&self) -> Box<dyn FamilyState> {
        Box::new(self.clone())
    }
}
