//! The CPU backend: host memory and `osprey-kernels`. Activations and states are `Vec<f32>`; a placed
//! weight is the host matrix itself (mapped from the checkpoint or the expert cache: placing copies
//! nothing). Every op calls the kernel the layers called before the seam, in the same order, so answers
//! are bit-identical to the pre-seam engine.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use osprey_backend::{
    AttnShape, Backend, BackendError, BackendRef, DType, Device, ExpertPool, ExpertShape, Fence, GdnShape, HostArena,
    HostData, HostExpert, HostMatrix, HostVec, MRope, Op, PagedView, Precision, Result, RopeTable, Routing, Storage,
    Tensor,
};
use osprey_kernels::attention::{bidirectional_attention, causal_attention_paged, PagedKv};
use osprey_kernels::gdn::{causal_conv_silu, gated_delta_chunked, gated_delta_recurrent, DeltaInputs};
use osprey_kernels::norm::{l2_norm, layer_norm, rms_norm, rms_norm_1p, rms_norm_gated};
use osprey_kernels::q8::Isa;
use osprey_kernels::rope::rotate_half_pairs;
use osprey_kernels::{gelu_erf, gelu_tanh, matmul_pair_with, matmul_with, sigmoid, silu, softplus, WeightRows};

use crate::experts::CpuPool;
use crate::host as fb;

/// What a CPU tensor holds.
#[derive(Debug)]
pub enum CpuStorage {
    /// Typed host elements (f32 activations, states, norms and KV pages; bf16 KV; i32 slot and page
    /// ids; bytes), what they are charged to the memory cap (given back on drop), and the thread that
    /// made them.
    Data(HostVec, Meta),
    /// A placed weight: the host matrix, not copied (mapped memory is not charged).
    Matrix(Arc<dyn HostMatrix>),
}

/// Who a CPU tensor belongs to: its memory-cap charge and the thread that made it. The execution
/// contract (the trait's docs) gives each thread its own tensors; writes check it in debug builds, so a
/// tensor written by a thread that did not make it (the vision thread's activations on the runner's
/// queue, say) is caught by the tests. Weights and tensors only read are shared freely.
#[derive(Debug)]
pub struct Meta {
    charge: Option<Charge>,
    owner: std::thread::ThreadId,
}

impl Meta {
    fn new(charge: Option<Charge>) -> Self {
        Meta { charge, owner: std::thread::current().id() }
    }
}

/// Bytes of a tensor charged to a [`CpuBackend`]'s memory cap until the tensor drops.
#[derive(Debug)]
pub struct Charge {
    cap: Arc<MemoryCap>,
    bytes: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.cap.live.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A cap on the bytes of live tensors (`CpuBackend::with_memory_cap`): the CPU's stand-in for a
/// device's memory, so the path a device's out-of-memory takes is tested here.
#[derive(Debug)]
pub struct MemoryCap {
    cap: usize,
    live: AtomicUsize,
}

impl MemoryCap {
    /// Charges `bytes`, or refuses when the cap would be passed.
    fn charge(self: &Arc<Self>, bytes: usize) -> Result<Charge> {
        let live = self.live.fetch_add(bytes, Ordering::Relaxed);
        if live + bytes > self.cap {
            self.live.fetch_sub(bytes, Ordering::Relaxed);
            return Err(BackendError::OutOfMemory { requested: bytes, available: self.cap.saturating_sub(live) });
        }
        Ok(Charge { cap: self.clone(), bytes })
    }

    /// Bytes of live tensors.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

impl Storage for CpuStorage {
    fn bytes(&self) -> usize {
        match self {
            CpuStorage::Data(v, _) => v.bytes(),
            CpuStorage::Matrix(m) => m.bytes(),
        }
    }

    fn clone_storage(&self) -> Box<dyn Storage> {
        Box::new(match self {
            // A clone is charged like the original (over the cap only by what is already live: a copy
            // of a tensor in use is never the allocation that matters).
            CpuStorage::Data(v, meta) => {
                let charge = meta.charge.as_ref().map(|c| {
                    c.cap.live.fetch_add(c.bytes, Ordering::Relaxed);
                    Charge { cap: c.cap.clone(), bytes: c.bytes }
                });
                // The copy belongs to the thread that made it.
                CpuStorage::Data(v.clone(), Meta::new(charge))
            }
            CpuStorage::Matrix(m) => CpuStorage::Matrix(m.clone()),
        })
    }
}

/// The CPU backend: the kernels pick their SIMD path once at run time; `precision` says whether NVFP4
/// decode rows take int8 activations (the fast default) or f32 ones (the exact path parity tests use).
#[derive(Debug, Default)]
pub struct CpuBackend {
    /// Activation precision of the matmuls.
    pub precision: Precision,
    /// Most bytes of live tensors (none: bounded by the machine).
    cap: Option<Arc<MemoryCap>>,
}

impl CpuBackend {
    /// The process-wide instance at the default (fast) precision.
    pub fn shared() -> BackendRef {
        static CPU: OnceLock<BackendRef> = OnceLock::new();
        CPU.get_or_init(|| Arc::new(CpuBackend::default())).clone()
    }

    /// The process-wide exact instance: f32 activations everywhere (the parity tests' backend).
    pub fn exact() -> BackendRef {
        static CPU: OnceLock<BackendRef> = OnceLock::new();
        CPU.get_or_init(|| Arc::new(CpuBackend { precision: Precision::Exact, cap: None })).clone()
    }

    /// A backend whose live tensors (activations, states, KV pages; not the mapped weights) may take
    /// at most `bytes`: an allocation past it is [`BackendError::OutOfMemory`], as on a device.
    pub fn with_memory_cap(precision: Precision, bytes: usize) -> BackendRef {
        Arc::new(CpuBackend { precision, cap: Some(Arc::new(MemoryCap { cap: bytes, live: AtomicUsize::new(0) })) })
    }

    /// The cap's account, when there is one.
    pub fn memory_cap(&self) -> Option<&MemoryCap> {
        self.cap.as_deref()
    }

    pub(crate) fn tensor(&self, shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
        self.typed(shape, HostVec::F32(data))
    }

    fn typed(&self, shape: &[usize], data: HostVec) -> Result<Tensor> {
        let dtype = data.as_data().dtype();
        debug_assert_eq!(shape.iter().product::<usize>(), data.as_data().len());
        let charge = self.cap.as_ref().map(|c| c.charge(data.bytes())).transpose()?;
        Ok(Tensor::new(shape.to_vec(), dtype, Device::Cpu, Box::new(CpuStorage::Data(data, Meta::new(charge)))))
    }
}

/// A CPU tensor's typed elements.
pub fn host_data(t: &Tensor) -> &HostVec {
    match t.storage::<CpuStorage>() {
        Some(CpuStorage::Data(v, _)) => v,
        other => panic!("expected a CPU tensor with data, got {other:?}: this is a bug"),
    }
}

/// A CPU tensor's typed elements, mutably (by the thread that made it: the execution contract).
pub fn host_data_mut(t: &mut Tensor) -> &mut HostVec {
    match t.storage_mut::<CpuStorage>() {
        Some(CpuStorage::Data(v, meta)) => {
            debug_assert_eq!(
                meta.owner,
                std::thread::current().id(),
                "a tensor written by a thread that did not make it (the backend's execution contract): this is a bug"
            );
            v
        }
        _ => panic!("expected a CPU tensor with data: this is a bug"),
    }
}

/// An f32 CPU tensor's elements.
pub fn host(t: &Tensor) -> &[f32] {
    match host_data(t) {
        HostVec::F32(v) => v,
        other => panic!("expected an f32 CPU tensor, got {:?}: this is a bug", other.as_data().dtype()),
    }
}

/// An f32 CPU tensor's elements, mutably.
pub fn host_mut(t: &mut Tensor) -> &mut [f32] {
    match host_data_mut(t) {
        HostVec::F32(v) => v,
        _ => panic!("expected an f32 CPU tensor: this is a bug"),
    }
}

/// The i32 elements of a CPU tensor (slot ids, page tables, selected blocks).
fn host_i32(t: &Tensor) -> &[i32] {
    match host_data(t) {
        HostVec::I32(v) => v,
        other => panic!("expected an i32 CPU tensor, got {:?}: this is a bug", other.as_data().dtype()),
    }
}

/// One plane (K or V) per page, as f32.
type Planes<'a> = Vec<Cow<'a, [f32]>>;

/// The K and V planes of the first `pages` pages of a sequence's table, as f32 (borrowed from an f32
/// pool, widened from a bf16 one).
fn kv_planes<'a>(kv: &PagedView<'a>, pages: usize, row: usize) -> (Planes<'a>, Planes<'a>) {
    let span = kv.page_size * row;
    let plane = |p: i32, v: bool| -> Cow<'a, [f32]> {
        let at = kv.k_row(p as usize, 0) * row + usize::from(v) * span;
        match host_data(kv.pool) {
            HostVec::F32(d) => Cow::Borrowed(&d[at..at + span]),
            HostVec::Bf16(d) => {
                Cow::Owned(d[at..at + span].iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect())
            }
            other => panic!("a KV pool of {:?}: this is a bug", other.as_data().dtype()),
        }
    };
    host_i32(kv.table)[..pages].iter().map(|&p| (plane(p, false), plane(p, true))).unzip()
}

fn matrix(t: &Tensor) -> &dyn HostMatrix {
    match t.storage::<CpuStorage>() {
        Some(CpuStorage::Matrix(m)) => m.as_ref(),
        other => panic!("expected a placed CPU weight, got {other:?}: this is a bug"),
    }
}

/// Top-k routing of one token with the kept weights renormalised (see [`fb::route`]).
pub fn route(logits: &[f32], top_k: usize) -> (Vec<usize>, Vec<f32>) {
    fb::route(logits, top_k, true)
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn supports(&self, _op: Op) -> bool {
        true // every op runs here, in place on host memory
    }

    fn describe(&self) -> String {
        // The f32 / bf16 kernels use AVX2+FMA where `Isa` finds it (the same detection, x86 or not).
        let simd = if Isa::available().contains(&Isa::Avx2) { "avx2+fma" } else { "portable" };
        let fast = match self.precision {
            Precision::Int8 if osprey_kernels::bf16::available() => {
                format!("nvfp4 int8 {}, bf16 tiles avx512-bf16", Isa::detected().name())
            }
            Precision::Int8 => format!("nvfp4 int8 {}, bf16 f32", Isa::detected().name()),
            Precision::Exact => "exact f32 activations".to_string(),
        };
        format!("cpu ({simd} kernels, {fast}, {} threads)", osprey_kernels::threads())
    }

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

    fn scatter_add_rows(&self, out: &mut Tensor, rows: &[usize], weights: &[f32], y: &Tensor) {
        let (h, d) = (out.cols(), host(y));
        let o = host_mut(out);
        for (j, (&i, &wt)) in rows.iter().zip(weights).enumerate() {
            for (o, v) in o[i * h..(i + 1) * h].iter_mut().zip(&d[j * h..(j + 1) * h]) {
                *o += v * wt;
            }
        }
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

    fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let w = matrix(w);
        let m = x.rows();
        let mut out = vec![0f32; m * w.rows()];
        matmul_with(host(x), m, w.view(), w.rows(), w.cols(), &mut out, self.precision);
        self.tensor(&[m, w.rows()], out)
    }

    fn linear_pair(&self, x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<(Tensor, Tensor)> {
        let (a, b) = (matrix(w1), matrix(w2));
        assert!(a.rows() == b.rows() && a.cols() == b.cols(), "linear_pair shapes: this is a bug");
        let m = x.rows();
        let (mut o1, mut o2) = (vec![0f32; m * a.rows()], vec![0f32; m * a.rows()]);
        let views = (a.view(), b.view());
        matmul_pair_with(host(x), m, views, a.rows(), a.cols(), (&mut o1, &mut o2), self.precision);
        Ok((self.tensor(&[m, a.rows()], o1)?, self.tensor(&[m, a.rows()], o2)?))
    }

    fn embed(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let w = matrix(table);
        let h = w.cols();
        let mut out = vec![0f32; ids.len() * h];
        let view = w.view();
        for (i, &t) in ids.iter().enumerate() {
            view.row_f32(t as usize, h, &mut out[i * h..(i + 1) * h]);
        }
        self.tensor(&[ids.len(), h], out)
    }

    fn add(&self, x: &mut Tensor, y: &Tensor) {
        host_mut(x).iter_mut().zip(host(y)).for_each(|(a, b)| *a += b);
    }

    fn add_bias(&self, x: &mut Tensor, bias: &Tensor) {
        let bs = host(bias);
        for row in host_mut(x).chunks_mut(bs.len()) {
            row.iter_mut().zip(bs).for_each(|(a, b)| *a += b);
        }
    }

    fn scale(&self, x: &mut Tensor, s: f32) {
        host_mut(x).iter_mut().for_each(|v| *v *= s);
    }

    fn silu_mul(&self, gate: &mut Tensor, up: &Tensor) {
        for (a, b) in host_mut(gate).iter_mut().zip(host(up)) {
            *a = silu(*a) * b;
        }
    }

    fn sigmoid_mul(&self, x: &mut Tensor, gate: &Tensor) {
        for (a, g) in host_mut(x).iter_mut().zip(host(gate)) {
            *a *= sigmoid(*g);
        }
    }

    fn add_sigmoid_gated(&self, out: &mut Tensor, y: &Tensor, gate: &Tensor) {
        let h = out.cols();
        let (ys, gs) = (host(y), host(gate));
        for (i, row) in host_mut(out).chunks_mut(h).enumerate() {
            let g = sigmoid(gs[i]);
            for (o, s) in row.iter_mut().zip(&ys[i * h..(i + 1) * h]) {
                *o += g * s;
            }
        }
    }

    fn gelu(&self, x: &mut Tensor, tanh: bool) {
        let f = if tanh { gelu_tanh } else { gelu_erf };
        host_mut(x).iter_mut().for_each(|v| *v = f(*v));
    }

    fn rms_norm(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool) {
        if one_plus {
            rms_norm_1p(host_mut(x), host(w), eps);
        } else {
            rms_norm(host_mut(x), host(w), eps);
        }
    }

    fn rms_norm_gated(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        rms_norm_gated(host_mut(x), host(z), host(w), eps);
    }

    fn l2_norm(&self, x: &mut Tensor, group: usize, eps: f32) {
        l2_norm(host_mut(x), group, eps);
    }

    fn layer_norm(&self, x: &mut Tensor, w: &Tensor, b: &Tensor, eps: f32) {
        layer_norm(host_mut(x), host(w), host(b), eps);
    }

    fn rope_table(&self, rope: &MRope, positions: &[[i64; 3]]) -> Result<RopeTable> {
        let half = rope.rot_dim() / 2;
        let mut cos = vec![0f32; positions.len() * half];
        let mut sin = vec![0f32; positions.len() * half];
        for (i, p) in positions.iter().enumerate() {
            rope.cos_sin(*p, &mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
        }
        let shape = [positions.len(), half];
        Ok(RopeTable { cos: self.tensor(&shape, cos)?, sin: self.tensor(&shape, sin)? })
    }

    fn rope(&self, x: &mut Tensor, rope: &MRope, table: &RopeTable) {
        let (half, c) = (table.cos.cols(), x.cols());
        let (cos, sin) = (host(&table.cos), host(&table.sin));
        for (i, row) in host_mut(x).chunks_mut(c).enumerate() {
            osprey_kernels::rope::apply(rope, row, &cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
        }
    }

    fn rotate_half(&self, x: &mut Tensor, head_dim: usize, cos: &Tensor, sin: &Tensor) {
        let (half, c) = (cos.cols(), x.cols());
        let (cs, sn) = (host(cos), host(sin));
        for (i, row) in host_mut(x).chunks_mut(c).enumerate() {
            rotate_half_pairs(row, head_dim, &cs[i * half..(i + 1) * half], &sn[i * half..(i + 1) * half]);
        }
    }

    fn attention_paged(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        kv: PagedView<'_>,
        past: usize,
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        let row = shape.kv_heads * shape.head_dim;
        let (k, v) = kv_planes(&kv, (past + rows.len()).div_ceil(kv.page_size), row);
        let (k, v): (Vec<&[f32]>, Vec<&[f32]>) = (k.iter().map(|p| &**p).collect(), v.iter().map(|p| &**p).collect());
        let c = q.cols();
        let paged = PagedKv { k: &k, v: &v, page: kv.page_size };
        let q = &host(q)[rows.start * c..rows.end * c];
        causal_attention_paged(q, paged, past, shape, scale, &mut host_mut(out)[rows.start * c..rows.end * c]);
    }

    fn attention_bidirectional(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rows: Range<usize>,
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        let (qc, kc) = (q.cols(), k.cols());
        let (q, k, v) = (
            &host(q)[rows.start * qc..rows.end * qc],
            &host(k)[rows.start * kc..rows.end * kc],
            &host(v)[rows.start * kc..rows.end * kc],
        );
        bidirectional_attention(q, k, v, shape, scale, &mut host_mut(out)[rows.start * qc..rows.end * qc]);
    }

    fn causal_conv_silu(
        &self,
        x: &Tensor,
        rows: Range<usize>,
        w: &Tensor,
        kernel: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let c = x.cols();
        let mut out = vec![0f32; rows.len() * c];
        causal_conv_silu(&host(x)[rows.start * c..rows.end * c], c, host(w), kernel, host_mut(state), &mut out);
        self.tensor(&[rows.len(), c], out)
    }

    fn delta_gates(
        &self,
        a: &Tensor,
        b: &Tensor,
        rows: Range<usize>,
        neg_a: &Tensor,
        dt_bias: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let nv = a.cols();
        let (a, b, neg_a, dt_bias) = (host(a), host(b), host(neg_a), host(dt_bias));
        let n = rows.len();
        let mut beta = vec![0f32; n * nv];
        let mut g = vec![0f32; n * nv];
        for i in 0..n {
            for h in 0..nv {
                let idx = (rows.start + i) * nv + h;
                beta[i * nv + h] = sigmoid(b[idx]);
                g[i * nv + h] = neg_a[h] * softplus(a[idx] + dt_bias[h]);
            }
        }
        Ok((self.tensor(&[n, nv], beta)?, self.tensor(&[n, nv], g)?))
    }

    fn gated_delta(
        &self,
        shape: GdnShape,
        recurrent: bool,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let n = q.rows();
        let mut out = vec![0f32; n * shape.nv * shape.dv];
        let inp = DeltaInputs { q: host(q), k: host(k), v: host(v), g: host(g), beta: host(beta) };
        if recurrent {
            gated_delta_recurrent(shape, inp, host_mut(state), &mut out);
        } else {
            gated_delta_chunked(shape, inp, host_mut(state), &mut out);
        }
        self.tensor(&[n, shape.nv * shape.dv], out)
    }

    fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing> {
        let (ids, weights) = fb::route_sorted(host(logits), logits.cols(), k, renorm);
        let t = logits.rows();
        Ok(Routing { ids: self.typed(&[t, k], HostVec::I32(ids))?, weights: self.tensor(&[t, k], weights)? })
    }

    fn alloc_host_arena(&self, bytes: usize) -> Result<HostArena> {
        crate::experts::arena(bytes)
    }

    fn alloc_expert_pool(&self, layer: u32, slots: usize, shape: ExpertShape) -> Result<ExpertPool> {
        // Slots alias host experts: the pool itself holds no expert memory.
        let storage = CpuPool((0..slots).map(|_| None).collect());
        Ok(ExpertPool::new(layer, shape, slots, Box::new(storage)))
    }

    fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, expert: HostExpert) -> Result<Fence> {
        let key = expert.key;
        let cpu =
            pool.storage_mut::<CpuPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        let at = cpu.0.get_mut(slot).ok_or_else(|| BackendError::Slot(format!("slot {slot} out of the pool")))?;
        *at = Some(expert); // the previous expert's lease ends here
        pool.set_key(slot, key);
        Ok(Fence::DONE)
    }

    fn moe_routed(
        &self,
        x: &Tensor,
        slots: &Tensor,
        weights: &Tensor,
        pool: &ExpertPool,
        partials: &mut Tensor,
    ) -> Result<()> {
        self.routed(x, slots, weights, pool, partials)
    }

    fn moe_combine(&self, partials: &Tensor, k: usize) -> Result<Tensor> {
        self.combine(partials, k)
    }

    fn record_fence(&self) -> Fence {
        Fence::DONE // every op has run when it returns
    }

    fn fence_complete(&self, _fence: Fence) -> bool {
        true
    }

    fn wait_fence(&self, _fence: Fence) -> Result<()> {
        Ok(())
    }

    // qwen4_exp's ops: the host code of `host.rs`, on the tensors in place (no copies).

    fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32) {
        fb::rms_norm_grouped(host_mut(x), host(w), group, eps);
    }

    fn silu(&self, x: &mut Tensor) {
        host_mut(x).iter_mut().for_each(|v| *v = silu(*v));
    }

    fn sigmoid(&self, x: &mut Tensor) {
        host_mut(x).iter_mut().for_each(|v| *v = sigmoid(*v));
    }

    fn hc_combine(&self, m: &Tensor, xn: &Tensor, hc: usize) -> Result<Tensor> {
        let h = m.cols() / hc;
        self.tensor(&[m.rows(), h], fb::hc_combine(host(m), host(xn), hc, h))
    }

    fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize) {
        fb::hc_inject(host_mut(x), host(out), host(inj), hc, out.cols());
    }

    fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Result<Tensor> {
        self.tensor(k.shape(), fb::ple_gate(host(k), host(q), host(v), hc, v.cols()))
    }

    fn causal_conv_dilated_silu(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        dilation: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let out = fb::causal_conv_dilated_silu(host(x), x.cols(), host(w), kernel, dilation, host_mut(state));
        self.tensor(x.shape(), out)
    }

    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        fb::rms_norm_gated_sigmoid(host_mut(x), host(z), host(w), eps);
    }

    fn mean_rows(&self, x: &Tensor, rows: Range<usize>) -> Result<Tensor> {
        let c = x.cols();
        let mean = fb::mean_rows(&host(x)[rows.start * c..rows.end * c], rows.len(), c);
        self.tensor(&[1, c], mean)
    }

    fn qsa_select(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        keys: &Tensor,
        past: usize,
        ratio: usize,
        top: usize,
        heads: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (c, d) = (q.cols(), keys.cols());
        let ids =
            fb::qsa_select(&host(q)[rows.start * c..rows.end * c], host(keys), (past, ratio, top), heads, d, scale);
        self.typed(&[rows.len(), top], HostVec::I32(ids))
    }

    fn attention_selected(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        kv: PagedView<'_>,
        blocks: &Tensor,
        (past, ratio): (usize, usize),
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        let row = shape.kv_heads * shape.head_dim;
        let ps = kv.page_size;
        let (kp, vp) = kv_planes(&kv, (past + rows.len()).div_ceil(ps), row);
        let fetch = |pos: usize| fb::kv_rows((&kp[pos / ps], &vp[pos / ps]), pos % ps, row);
        let (c, top) = (q.cols(), blocks.cols());
        let ids = host_i32(blocks);
        let selected: Vec<Vec<usize>> =
            (0..rows.len()).map(|j| fb::selected_positions(&ids[j * top..(j + 1) * top], past + j, ratio)).collect();
        let qh = &host(q)[rows.start * c..rows.end * c];
        // Query rows are independent: blocks of 4 split across the pool.
        const BLOCK: usize = 4;
        osprey_kernels::pool::chunks_mut(&mut host_mut(out)[rows.start * c..rows.end * c], BLOCK * c, |b, o| {
            let r0 = b * BLOCK;
            let n = o.len() / c;
            fb::attention_selected(
                &qh[r0 * c..(r0 + n) * c],
                &selected[r0..r0 + n],
                &fetch,
                (shape.heads, shape.kv_heads, shape.head_dim),
                scale,
                o,
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sharing rule of the execution contract is enforced: a thread may read another's tensor, but
    /// writing one it did not make is a bug the debug build stops (mutation: without the check in
    /// `host_mut` the write goes through and this test fails).
    #[test]
    #[cfg(debug_assertions)]
    fn a_tensor_written_by_a_thread_that_did_not_make_it_is_refused() {
        let b = CpuBackend::default();
        let mut t = b.upload_f32(&[1.0, 2.0], &[1, 2]).expect("upload");
        host_mut(&mut t)[0] = 3.0;
        let read = std::thread::scope(|s| s.spawn(|| host(&t)[0]).join());
        assert_eq!(read.ok(), Some(3.0), "reads are shared");
        // A copy belongs to the thread that made it.
        let mut copy = std::thread::scope(|s| s.spawn(|| t.clone()).join().expect("clone"));
        let write = std::thread::spawn(move || host_mut(&mut t)[0] = 4.0).join();
        assert!(write.is_err(), "a write from another thread panics");
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| host_mut(&mut copy)[0] = 5.0)).is_err());
    }

    #[test]
    fn route_picks_top_k_and_renormalises() {
        let (ids, w) = route(&[0.0, 2.0, 1.0, 2.0], 2);
        assert_eq!(ids, vec![1, 3]);
        assert!((w[0] - 0.5).abs() < 1e-6 && (w[1] - 0.5).abs() < 1e-6);
        let (ids, w) = route(&[3.0, 0.0, 1.0], 2);
        assert_eq!(ids, vec![0, 2]);
        let e = (2.0f32).exp();
        assert!((w[0] - e / (e + 1.0)).abs() < 1e-6);
    }

    #[test]
    fn split_gather_scatter_and_rows_move_the_right_elements() {
        let b = CpuBackend::default();
        let x = b.upload_f32(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), &[2, 6]).expect("upload");
        // Two heads of [a a | g] per row.
        let parts = b.split_cols(&x, 2, &[2, 1]).expect("split");
        assert_eq!(host(&parts[0]), &[0.0, 1.0, 3.0, 4.0, 6.0, 7.0, 9.0, 10.0]);
        assert_eq!(host(&parts[1]), &[2.0, 5.0, 8.0, 11.0]);
        let g = b.gather_rows(&x, &[1, 0]).expect("gather");
        assert_eq!(&host(&g)[..6], &host(&x)[6..]);
        let mut out = b.zeros_f32(&[2, 6]).expect("zeros");
        b.scatter_add_rows(&mut out, &[1], &[2.0], &b.gather_rows(&x, &[0]).expect("gather"));
        assert_eq!(&host(&out)[6..], &[0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let mut dst = b.zeros_f32(&[3, 6]).expect("zeros");
        b.write_rows(&mut dst, 6, &x, 1..2);
        assert_eq!(&host(&dst)[6..12], &host(&x)[6..]);
    }

    #[test]
    fn memory_is_typed() {
        let b = CpuBackend::default();
        let ids = b.upload(HostData::I32(&[3, -1, 7]), &[3]).expect("upload");
        assert_eq!((ids.dtype(), ids.bytes()), (DType::I32, 12));
        assert_eq!(b.download(&ids).expect("download"), HostVec::I32(vec![3, -1, 7]));
        let half = b.zeros(DType::BF16, &[2, 2]).expect("zeros");
        assert_eq!((half.dtype(), half.bytes()), (DType::BF16, 8));
        assert!(b.download_f32(&half).is_err(), "a bf16 tensor is not read as f32");
    }
}
