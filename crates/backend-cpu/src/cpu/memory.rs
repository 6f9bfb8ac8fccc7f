//! The CPU's memory and fences: tensors are host vectors, placing a weight copies nothing, and every op
//! has run when it returns, so a fence is always complete.

use super::*;

impl MemoryOps for CpuBackend {
    fn place_weight(&self, w: Arc<dyn HostMatrix>) -> Result<Tensor> {
        let (shape, dtype) = (vec![w.rows(), w.cols()], w.dtype());
        Ok(Tensor::new(shape, dtype, Device::Cpu, Box::new(CpuStorage::Matrix(w))))
    }

    fn upload(&self, data: HostData<'_>, shape: &[usize]) -> Result<Tensor> {
        let owned = match data {
            HostData::F32(v) => HostVec::F32(v.to_vec()),
            HostData::Bf16(v) => HostVec::Bf16(v.to_vec()),
            HostData::F16(v) => HostVec::F16(v.to_vec()),
            HostData::U8(v) => HostVec::U8(v.to_vec()),
            HostData::I32(v) => HostVec::I32(v.to_vec()),
        };
        self.typed(shape, owned)
    }

    fn download(&self, t: &Tensor) -> Result<HostVec> {
        match t.storage::<CpuStorage>() {
            Some(CpuStorage::Data(v, _)) => Ok(v.clone()),
            other => panic!("expected a CPU data tensor, got {other:?}: this is a bug"),
        }
    }

    fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n = shape.iter().product();
        let data = match dtype {
            DType::F32 => HostVec::F32(vec![0.0; n]),
            DType::BF16 => HostVec::Bf16(vec![0; n]),
            DType::F16 => HostVec::F16(vec![0; n]),
            DType::U8 => HostVec::U8(vec![0; n]),
            DType::I32 => HostVec::I32(vec![0; n]),
            DType::Nvfp4 => panic!("NVFP4 tensors are placed weights, not zeros: this is a bug"),
        };
        self.typed(shape, data)
    }

    fn write_rows(&self, dst: &mut Tensor, at: usize, src: &Tensor, rows: Range<usize>) {
        let c = src.cols();
        let r = rows.start * c..rows.end * c;
        match (host_data_mut(dst), host_data(src)) {
            (HostVec::F32(d), HostVec::F32(s)) => d[at..at + r.len()].copy_from_slice(&s[r]),
            // One rounding for every machine (the AVX512-BF16 row kernel flushes subnormals).
            (HostVec::Bf16(d), HostVec::F32(s)) => {
                d[at..at + r.len()].iter_mut().zip(&s[r]).for_each(|(d, &s)| *d = osprey_kernels::bf16::round(s))
            }
            (HostVec::Bf16(d), HostVec::Bf16(s)) => d[at..at + r.len()].copy_from_slice(&s[r]),
            (d, s) => panic!("write_rows of {:?} into {:?}: this is a bug", s.as_data().dtype(), d.as_data().dtype()),
        }
    }

    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        fn gather<T: Copy>(xs: &[T], c: usize, rows: &[usize]) -> Vec<T> {
            let mut out = Vec::with_capacity(rows.len() * c);
            for &i in rows {
                out.extend_from_slice(&xs[i * c..(i + 1) * c]);
            }
            out
        }
        let c = x.cols();
        let data = match host_data(x) {
            HostVec::F32(v) => HostVec::F32(gather(v, c, rows)),
            HostVec::Bf16(v) => HostVec::Bf16(gather(v, c, rows)),
            other => panic!("gather_rows of {:?}: this is a bug", other.as_data().dtype()),
        };
        self.typed(&[rows.len(), c], data)
    }

    fn split_cols(&self, x: &Tensor, heads: usize, parts: &[usize]) -> Result<Vec<Tensor>> {
        let (t, xs) = (x.rows(), host(x));
        let group: usize = parts.iter().sum();
        let mut outs: Vec<Vec<f32>> = parts.iter().map(|p| Vec::with_capacity(t * heads * p)).collect();
        for unit in xs.chunks(group) {
            let mut at = 0;
            for (o, &p) in outs.iter_mut().zip(parts) {
                o.extend_from_slice(&unit[at..at + p]);
                at += p;
            }
        }
        outs.into_iter().zip(parts).map(|(o, &p)| self.tensor(&[t, heads * p], o)).collect()
    }

    fn alloc_host_arena(&self, bytes: usize) -> Result<HostArena> {
        super::experts::arena(bytes)
    }

    fn record_fence(&self) -> Fence {
        Fence::DONE // every op has run when it returns
    }

    fn wait_fence(&self, _fence: Fence) -> Result<()> {
        Ok(())
    }
}
