//! Device tensors: shape, dtype and device in the open, storage opaque to everyone but its backend.

use std::any::Any;
use std::fmt::Debug;

use crate::types::{DType, WeightView};

use crate::Device;

/// A backend's memory behind a tensor. Only the backend that made it downcasts it.
pub trait Storage: Any + Send + Sync + Debug {
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// A copy (device memory: a device-to-device copy; mapped weights: another handle to them).
    fn clone_storage(&self) -> Box<dyn Storage>;
}

/// A weight matrix in host memory, as a checkpoint or the expert residency manager holds it: what
/// [`crate::Backend::place_weight`] places (the CPU backend keeps the handle, a device backend uploads).
pub trait HostMatrix: Send + Sync + Debug {
    /// Output features.
    fn rows(&self) -> usize;
    /// Input features.
    fn cols(&self) -> usize;
    /// Stored element type.
    fn dtype(&self) -> DType;
    /// Bytes of weight data.
    fn bytes(&self) -> usize;
    /// A typed view for the kernels.
    fn view(&self) -> WeightView<'_>;
}

/// A tensor on a device: row-major, `shape` outermost first.
#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    storage: Box<dyn Storage>,
}

impl Clone for Tensor {
    fn clone(&self) -> Self {
        Tensor {
            shape: self.shape.clone(),
            dtype: self.dtype,
            device: self.device,
            storage: self.storage.clone_storage(),
        }
    }
}

impl Tensor {
    /// A tensor over `storage` (for backends).
    pub fn new(shape: Vec<usize>, dtype: DType, device: Device, storage: Box<dyn Storage>) -> Self {
        Tensor { shape, dtype, device, storage }
    }

    /// Dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where it lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Length of the last dimension (a row).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Rows: every dimension but the last.
    pub fn rows(&self) -> usize {
        self.numel() / self.cols().max(1)
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.storage.bytes()
    }

    /// The same elements under another shape.
    pub fn reshape(mut self, shape: &[usize]) -> Self {
        assert_eq!(shape.iter().product::<usize>(), self.numel(), "reshape keeps the elements: this is a bug");
        self.shape = shape.to_vec();
        self
    }

    /// The storage as the backend's own type.
    pub fn storage<T: Storage>(&self) -> Option<&T> {
        let any: &dyn Any = self.storage.as_ref();
        any.downcast_ref()
    }

    /// The storage as the backend's own type, mutably.
    pub fn storage_mut<T: Storage>(&mut self) -> Option<&mut T> {
        let any: &mut dyn Any = self.storage.as_mut();
        any.downcast_mut()
    }
}
