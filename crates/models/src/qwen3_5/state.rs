//! Qwen3.5's own per-sequence state: per layer, the Gated DeltaNet conv + fp32 recurrent state, or which
//! plane of the KV page table a full-attention layer writes. Snapshots keep the linear states only (KV
//! rows live in pages, shared with the prefix cache).

use std::any::Any;

use osprey_backend::Backend;

use crate::error::{Error, Result};
use crate::layers::gdn::{HostLinearState, LinearState};
use crate::state::{FamilySnapshot, FamilyState};

#[derive(Clone, Debug)]
pub(crate) enum LayerState {
    Linear(LinearState),
    /// A full-attention layer: its rows are plane `kv_layer` of the page table.
    Full {
        kv_layer: usize,
    },
}

/// The hybrid stack's state.
#[derive(Clone, Debug)]
pub(crate) struct HybridState {
    pub(crate) layers: Vec<LayerState>,
}

/// The linear states, in layer order, in host memory.
#[derive(Clone, Debug)]
struct HybridSnapshot {
    linear: Vec<HostLinearState>,
}

impl FamilySnapshot for HybridSnapshot {
    fn bytes(&self) -> usize {
        self.linear.iter().map(HostLinearState::bytes).sum()
    }
}

impl FamilyState for HybridState {
    fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => s.bytes(),
                LayerState::Full { .. } => 0,
            })
            .sum()
    }

    fn snapshot(&self, b: &dyn Backend) -> Result<Box<dyn FamilySnapshot>> {
        let linear = self
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Linear(s) => Some(s.to_host(b)),
                LayerState::Full { .. } => None,
            })
            .collect::<Result<_>>()?;
        Ok(Box::new(HybridSnapshot { linear }))
    }

    fn restore(&mut self, snap: &dyn FamilySnapshot, b: &dyn Backend) -> Result<()> {
        let any: &dyn Any = snap;
        let snap = any
            .downcast_ref::<HybridSnapshot>()
            .ok_or_else(|| Error::Engine("snapshot belongs to another model family".into()))?;
        let n_linear = self.layers.iter().filter(|l| matches!(l, LayerState::Linear(_))).count();
        if n_linear != snap.linear.len() {
            return Err(Error::Engine("snapshot belongs to another model".into()));
        }
        let mut lin = snap.linear.iter();
        for l in &mut self.layers {
            if let LayerState::Linear(s) = l {
                if let Some(src) = lin.next() {
                    s.restore(src, b)?;
                }
            }
        }
        Ok(())
    }

    fn boxed_clone(&self) -> Box<dyn FamilyState> {
        Box::new(self.clone())
    }

    fn rewind(&mut self, keep: usize) -> Result<()> {
        for l in &mut self.layers {
            if let LayerState::Linear(s) = l {
                s.rewind(keep)?;
            }
        }
        Ok(())
    }
}
