//! Memory and fences on the device: uploads and downloads are copies through the device layer, row
//! moves are kernels (`kernels/memory.cu`), fences are events.

use std::ops::Range;
use std::sync::Arc;

use osprey_backend::{
    BackendError, DType, Fence, HostArena, HostData, HostMatrix, HostVec, MemoryOps, Result, Tensor, WeightView,
};

use super::{ptr, u32_of, Buf, CudaBackend, CudaStorage, Placed};
use crate::device::{DeviceLayer as _, LaunchConfig};
use crate::launch;

/// The bytes of typed host data.
fn bytes_of(data: HostData<'_>) -> (DType, Vec<u8>) {
    match data {
        HostData::F32(v) => (DType::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostData::Bf16(v) => (DType::BF16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostData::F16(v) => (DType::F16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostData::U8(v) => (DType::U8, v.to_vec()),
        HostData::I32(v) => (DType::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

/// Typed elements from little-endian bytes.
fn typed(dtype: DType, b: &[u8]) -> Result<HostVec> {
    let u16s = || b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let words = |f: fn([u8; 4]) -> u32| b.chunks_exact(4).map(move |c| f([c[0], c[1], c[2], c[3]]));
    Ok(match dtype {
        DType::F32 => HostVec::F32(words(u32::from_le_bytes).map(f32::from_bits).collect()),
        DType::BF16 => HostVec::Bf16(u16s()),
        DType::F16 => HostVec::F16(u16s()),
        DType::U8 => HostVec::U8(b.to_vec()),
        DType::I32 => HostVec::I32(words(u32::from_le_bytes).map(|w| w as i32).collect()),
        DType::Nvfp4 => {
            return Err(BackendError::Device(
                "NVFP4 tensors are placed weights, never downloaded: this is a bug".into(),
            ))
        }
    })
}

impl CudaBackend {
    pub(super) fn upload_bytes(&self, b: &[u8]) -> Result<Buf> {
        let buf = self.buf(b.len())?;
        self.copy_to_device(buf.ptr, b)?;
        Ok(buf)
    }

    /// Uploads `ids` as an i32 device array (row lists of gathers and scatters).
    fn ids(&self, ids: &[usize]) -> Result<Tensor> {
        let v = ids.iter().map(|&i| i32::try_from(i)).collect::<std::result::Result<Vec<i32>, _>>();
        let v = v.map_err(|_| BackendError::Device("a row id over 2^31 on the CUDA backend".into()))?;
        self.upload(HostData::I32(&v), &[v.len()])
    }
}

impl MemoryOps for CudaBackend {
    fn place_weight(&self, w: Arc<dyn HostMatrix>) -> Result<Tensor> {
        let placed = match w.view() {
            WeightView::F32(v) => {
                Placed { data: self.upload_bytes(&bytes_of(HostData::F32(v)).1)?, scales: None, global: 1.0 }
            }
            WeightView::Bf16(v) => {
                Placed { data: self.upload_bytes(&bytes_of(HostData::Bf16(v)).1)?, scales: None, global: 1.0 }
            }
            WeightView::F16(v) => {
                Placed { data: self.upload_bytes(&bytes_of(HostData::F16(v)).1)?, scales: None, global: 1.0 }
            }
            WeightView::Nvfp4 { packed, scales, global } => {
                Placed { data: self.upload_bytes(packed)?, scales: Some(self.upload_bytes(scales)?), global }
            }
        };
        let storage = CudaStorage::Weight(Arc::new(placed));
        Ok(Tensor::new(vec![w.rows(), w.cols()], w.dtype(), self.device, Box::new(storage)))
    }

    fn upload(&self, data: HostData<'_>, shape: &[usize]) -> Result<Tensor> {
        let (dtype, b) = bytes_of(data);
        assert_eq!(b.len(), shape.iter().product::<usize>() * dtype.size(), "upload shape: this is a bug");
        let buf = self.upload_bytes(&b)?;
        Ok(Tensor::new(shape.to_vec(), dtype, self.device, Box::new(CudaStorage::Data(buf))))
    }

    fn download(&self, t: &Tensor) -> Result<HostVec> {
        let mut b = vec![0u8; t.numel() * t.dtype().size()];
        self.copy_to_host(ptr(t), &mut b)?;
        typed(t.dtype(), &b)
    }

    fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        assert!(dtype != DType::Nvfp4, "NVFP4 tensors are placed weights, not zeros: this is a bug");
        let t = self.empty(dtype, shape)?;
        self.dev.zero(ptr(&t), t.bytes()).map_err(super::seam_error)?;
        Ok(t)
    }

    fn write_rows(&self, dst: &mut Tensor, at: usize, src: &Tensor, rows: Range<usize>) {
        let c = src.cols();
        let n = rows.len() * c;
        let from = ptr(src).offset(rows.start * c * src.dtype().size());
        let to = ptr(dst).offset(at * dst.dtype().size());
        match (dst.dtype(), src.dtype()) {
            // A failed copy is the device's fault (`Counted` keeps it; the step's next fallible op says so).
            (DType::F32, DType::F32) | (DType::BF16, DType::BF16) => {
                let _ = self.dev.copy(to, from, n * src.dtype().size());
            }
            (DType::BF16, DType::F32) => {
                self.run(launch::f32_to_bf16_rows(from, to, u32_of(n)), LaunchConfig::elements(n))
            }
            (d, s) => self.fail("write_rows", format!("rows of {s:?} into {d:?}: this is a bug")),
        }
    }

    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        let c = x.cols();
        let out = self.empty(x.dtype(), &[rows.len(), c])?;
        if rows.is_empty() {
            return Ok(out);
        }
        let ids = self.ids(rows)?;
        let esize = x.dtype().size();
        let call = launch::gather_rows(ptr(x), ptr(&ids), ptr(&out), u32_of(rows.len()), u32_of(c), u32_of(esize));
        self.try_run(call, LaunchConfig::elements(rows.len() * c * esize))?;
        Ok(out)
    }

    fn split_cols(&self, x: &Tensor, heads: usize, parts: &[usize]) -> Result<Vec<Tensor>> {
        let gw: usize = parts.iter().sum();
        let rows = x.rows();
        let outs = parts.iter().map(|&p| self.empty(DType::F32, &[rows, heads * p])).collect::<Result<Vec<_>>>()?;
        // Four parts a launch (every caller has at most three); an absent part has width 0.
        let mut off = 0;
        for (ps, os) in parts.chunks(4).zip(outs.chunks(4)) {
            let w = |i: usize| ps.get(i).copied().unwrap_or(0);
            let o = |i: usize| os.get(i).map_or(ptr(&os[0]), ptr);
            let (r, h) = (u32_of(rows), u32_of(heads));
            let (w0, w1, w2, w3) = (u32_of(w(0)), u32_of(w(1)), u32_of(w(2)), u32_of(w(3)));
            let call =
                launch::split_cols_f32(ptr(x), o(0), o(1), o(2), o(3), r, h, u32_of(gw), u32_of(off), w0, w1, w2, w3);
            let width: usize = ps.iter().sum();
            self.try_run(call, LaunchConfig::elements(rows * heads * width))?;
            off += width;
        }
        Ok(outs)
    }

    fn alloc_host_arena(&self, bytes: usize) -> Result<HostArena> {
        self.dev.alloc_host(bytes).map_err(super::seam_error)
    }

    fn record_fence(&self) -> Fence {
        // After a fault (kept by `Counted`, reported at the next fallible op) no event can be recorded:
        // the done fence, which nothing will wait for usefully.
        Fence(self.dev.record().map_or(0, |e| e.0))
    }

    fn wait_fence(&self, fence: Fence) -> Result<()> {
        self.dev.synchronize(crate::device::Event(fence.0)).map_err(super::seam_error)
    }
}
