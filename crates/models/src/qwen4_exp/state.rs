//! `qwen4_exp`'s per-sequence state: per layer the Gated DeltaNet state or the KV plane and QSA keys,
//! the PLE conv state where the layer has PLE; per sequence the n-gram token history and the position
//! history the indexers rope blocks with. A snapshot is the whole of it (KV rows stay in pages), so a
//! prefix-cache hit resumes PLE, n-grams and the indexers exactly.

use std::any::Any;

use osprey_backend::Tensor;

use super::qsa::IndexerState;
use crate::error::{Error, Result};
use crate::layers::gdn::LinearState;
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

impl FamilySnapshot for Qwen4State {
    fn bytes(&self) -> usize {
        FamilyState::bytes(self)
    }
    fn boxed_clone(&self) -> Box<dyn FamilySnapshot> {
        Box::new(self.clone())
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

    fn snapshot(&self) -> Box<dyn FamilySnapshot> {
        Box::new(self.clone())
    }

    fn restore(&mut self, snap: &dyn FamilySnapshot) -> Result<()> {
        let any: &dyn Any = snap;
        let snap = any
            .downcast_ref::<Qwen4State>()
            .ok_or_else(|| Error::InvalidInput("snapshot belongs to another model family".into()))?;
        if snap.layers.len() != self.layers.len() {
            return Err(Error::InvalidInput("snapshot belongs to another model".into()));
        }
        self.clone_from(snap);
        Ok(())
    }

    fn boxed_clone(&self) -> Box<dyn FamilyState> {
        Box::new(self.clone())
    }
}
