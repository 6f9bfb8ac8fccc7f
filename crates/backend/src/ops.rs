//! The operation set of the seam. Tensors are row-major; "rows" are the tokens of a batch (every
//! dimension but the last). Ops that name a row range work on those rows of their inputs, so a layer can
//! run a sequence's part of a batch without copying it out. Shapes are checked by the caller (the family
//! built them); a mismatch is a bug and panics.
//!
//! Every op that allocates returns a [`Result`]: a device that runs out of memory answers
//! [`BackendError::OutOfMemory`], which fails the request that asked (503) instead of the runner
//! thread. Ops that write into tensors they are given allocate nothing and cannot fail that way.

use std::ops::Range;
use std::sync::Arc;

use crate::experts::{ExpertPool, ExpertShape, Fence, HostArena, HostExpert, Routing};
use crate::sampling::RowSampling;
use crate::types::{AttnShape, DType, GdnShape, HostData, HostTensor, HostVec, MRope};
use crate::{BackendError, Device, HostMatrix, Result, Tensor};

/// A shared backend.
pub type BackendRef = Arc<dyn Backend>;

/// A device's memory, and what the backend asked of it since start ([`Backend::stats`]): bytes each way,
/// kernel launches, host waits, allocations and frees (zero on a backend that computes in host memory).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Bytes of device memory (`None`: the backend computes in host memory).
    pub memory_total: Option<u64>,
    /// Bytes of device memory not allocated.
    pub memory_free: Option<u64>,
    /// Bytes copied host → device (uploads, placed weights, expert slots).
    pub bytes_to_device: u64,
    /// Bytes copied device → host (downloads, snapshots).
    pub bytes_from_device: u64,
    /// Kernel launches.
    pub launches: u64,
    /// Launches per kernel name.
    pub kernels: Vec<(String, u64)>,
    /// Calls that blocked the host until the device caught up (syncs, downloads, frees).
    pub host_waits: u64,
    /// Device memory allocations.
    pub allocations: u64,
    /// Device memory frees.
    pub frees: u64,
    /// What each kernel's launches cost, by name ([`KernelCost`]; empty on a backend without a device).
    pub costs: Vec<KernelCost>,
    /// The distinct bytes read and written in global memory between host waits, summed over every such
    /// window closed so far: the bytes the work must move at the least (`None` where the device does not
    /// measure memory traffic: only the emulated device does).
    pub window_bytes: Option<(u64, u64)>,
    /// Decode steps run as graphs ([`Backend::begin_step`]): built, launched, their nodes, and nodes
    /// updated in place before a replay.
    pub graphs: GraphStats,
}

/// What a backend's graphs did since start ([`DeviceStats::graphs`]; zero where none are built).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs built: a step shape's first step, or a step whose ops changed.
    pub built: u64,
    /// Graphs launched.
    pub launched: u64,
    /// Nodes of the launched graphs (kernel launches, copies, uploads).
    pub nodes: u64,
    /// Nodes updated in place before a replay (a launch's arguments, a copy's size or address).
    pub updated: u64,
}

/// Arithmetic by the unit that runs it: FP32 CUDA cores, bf16 tensor cores, int8 (tensor cores or
/// `dp4a`). A multiply-add is two.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flops {
    /// On FP32 cores.
    pub fp32: u64,
    /// On bf16 tensor cores.
    pub bf16: u64,
    /// On int8 tensor cores or `dp4a`.
    pub int8: u64,
}

impl std::ops::AddAssign for Flops {
    fn add_assign(&mut self, o: Flops) {
        (self.fp32, self.bf16, self.int8) = (self.fp32 + o.fp32, self.bf16 + o.bf16, self.int8 + o.int8);
    }
}

impl Flops {
    /// The difference from an `earlier` reading of the same counter.
    pub fn since(self, earlier: Flops) -> Flops {
        Flops {
            fp32: self.fp32.saturating_sub(earlier.fp32),
            bf16: self.bf16.saturating_sub(earlier.bf16),
            int8: self.int8.saturating_sub(earlier.int8),
        }
    }
}

/// The launches of one kernel since start: how many, the arithmetic they declare, and the global-memory
/// bytes they moved where the device measures them (the speed model's inputs, `osprey bench roofline`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelCost {
    /// The kernel (`cublasGemmEx`, `memcpy` and `memset` for the library's and the copy engine's work).
    pub name: String,
    /// Launches.
    pub launches: u64,
    /// The arithmetic the kernel declares for its launches' shapes.
    pub flops: Flops,
    /// Distinct bytes read and written in global memory, launch by launch (`None` on a real card).
    pub bytes: Option<(u64, u64)>,
}

/// Per-row rotary tables of one forward (shared by its attention layers).
#[derive(Clone, Debug)]
pub struct RopeTable {
    /// `[T, rot/2]`.
    pub cos: Tensor,
    /// `[T, rot/2]`.
    pub sin: Tensor,
}

/// One KV layer of a sequence as attention reads it: the layer's page pool and the sequence's page table.
/// The pool is `[pages · 2 · page_size, kv_heads · head_dim]`, f32 or bf16 (a half-size KV, widened as it
/// is read): page `p` keeps its K rows at rows `p·2·page_size ..`, its V rows right after, `page_size`
/// each. The table is `[pages]` i32 page ids in token order, on the backend.
#[derive(Clone, Copy, Debug)]
pub struct PagedView<'a> {
    /// The layer's page pool.
    pub pool: &'a Tensor,
    /// The sequence's page ids in token order.
    pub table: &'a Tensor,
    /// Slots per page.
    pub page_size: usize,
}

/// One sequence's rows of a step for [`AttentionOps::attention_paged_rows`]: rows `rows` of the query
/// are its tokens `past..past + rows.len()`, over its paged K/V `kv`.
#[derive(Clone, Debug)]
pub struct PagedRows<'a> {
    /// Rows of the query (and of the output).
    pub rows: Range<usize>,
    /// The sequence's KV layer.
    pub kv: PagedView<'a>,
    /// Tokens the sequence had before these rows.
    pub past: usize,
}

impl PagedView<'_> {
    /// Pool row of the K row of `slot` in page `page` (the V row is `page_size` rows further).
    pub fn k_row(&self, page: usize, slot: usize) -> usize {
        page * 2 * self.page_size + slot
    }
}

seam! {
    /// A compute backend: device memory and the operations model families are written in, declared as
    /// the groups below (one table: `ops.rs`). A backend implements each group trait and these three
    /// methods; a wrapper around another backend implements [`Wrapper`] instead.
    ///
    /// Execution contract. Ops run in the order a thread issues them (a device backend gives each
    /// calling thread its own queue; the CPU runs each op before it returns). Results reach the host only
    /// through [`MemoryOps::download`], which waits for the work before it. A [`Fence`] from
    /// [`MemoryOps::record_fence`] covers the work the calling thread issued before it; a slot may be
    /// overwritten only once its last reader's fence is complete, and a host buffer handed to
    /// [`ExpertOps::upload_expert`] is kept (with its lease) until the copy's fence is. One backend is
    /// shared by the runner thread and the vision encoder thread: each uses only the tensors it created
    /// (the vision tower's output reaches the runner as host rows, which the runner uploads), so the two
    /// queues never order against each other.
    backend;

    /// Memory and fences: placing weights, moving tensors between host and device, row copies, the
    /// pinned host arena, and the fences that order copies against compute.
    trait MemoryOps {
        /// Weights, uploads, downloads (typed and host snapshots), row copies, gathers and scatters,
        /// column splits, the host arena.
        op Memory {
            /// Places a weight on the device (at load; routed experts when they arrive).
            fn place_weight(&self, w: Arc<dyn HostMatrix>) -> Result<Tensor>;

            /// A tensor of `shape` from typed host data (its element type is the data's).
            fn upload(&self, data: HostData<'_>, shape: &[usize]) -> Result<Tensor>;

            /// A tensor's elements on the host, typed (waits for the device).
            fn download(&self, t: &Tensor) -> Result<HostVec>;

            /// A tensor of `dtype` zeros (f32, bf16, f16, u8 or i32).
            fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<Tensor>;

            /// [`MemoryOps::upload`] of f32 data (the activations' type).
            fn upload_f32(&self, data: &[f32], shape: &[usize]) -> Result<Tensor> = @derived {
                self.upload(HostData::F32(data), shape)
            };

            /// [`MemoryOps::download`] of an f32 tensor.
            fn download_f32(&self, t: &Tensor) -> Result<Vec<f32>> = @derived {
                match self.download(t)? {
                    HostVec::F32(v) => Ok(v),
                    _ => Err(BackendError::DType { expected: DType::F32, got: t.dtype() }),
                }
            };

            /// [`MemoryOps::zeros`] of f32.
            fn zeros_f32(&self, shape: &[usize]) -> Result<Tensor> = @derived {
                self.zeros(DType::F32, shape)
            };

            /// A tensor's shape and elements on the host (a host snapshot of device state). A device may
            /// copy asynchronously into pinned host memory: the returned copy may be read (uploaded,
            /// hashed, written out) only once a fence recorded after this call has completed. On the CPU
            /// it is complete at once.
            fn download_host(&self, t: &Tensor) -> Result<HostTensor> = {
                Ok(HostTensor { shape: t.shape().to_vec(), data: self.download(t)? })
            };

            /// A tensor from a host copy ([`MemoryOps::download_host`]); the caller has waited for the
            /// copy's fence.
            fn upload_host(&self, h: &HostTensor) -> Result<Tensor> = {
                self.upload(h.data.as_data(), &h.shape)
            };

            /// Copies `src` rows `rows` into `dst` starting at element `at` (KV page writes, injected
            /// rows). `dst` may be f32 or bf16 (a bf16 KV pool: f32 rows are rounded to nearest even);
            /// `src` is f32 or of `dst`'s type.
            fn write_rows(&self, dst: &mut Tensor, at: usize, src: &Tensor, rows: Range<usize>);

            /// Rows `rows` of `x`, gathered in that order, in `x`'s type (expert inputs, rows whose
            /// logits are wanted, a KV page copied).
            fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor>;

            /// Splits each row of `x`, viewed as `heads` groups of `parts.iter().sum()` columns, into one
            /// tensor per part (`[rows, heads·part]` each): `[q_h | gate_h]` per head, or `q | k | v`
            /// with one group.
            fn split_cols(&self, x: &Tensor, heads: usize, parts: &[usize]) -> Result<Vec<Tensor>>;

            /// Host memory for the expert RAM tier, `bytes` long, zeroed, 4 KiB-aligned: page-locked on
            /// a device (uploads from it are asynchronous copies), plain memory on the CPU. Allocated
            /// once at start.
            fn alloc_host_arena(&self, bytes: usize) -> Result<HostArena>;
        }

        /// `record_fence`, `wait_fence`.
        op Fences {
            /// A fence after every op queued so far on this backend (a slot's last reader, a copy).
            fn record_fence(&self) -> Fence;

            /// Blocks until the work before `fence` has run.
            fn wait_fence(&self, fence: Fence) -> Result<()>;
        }
    }

    /// Core tensor ops: matmuls, embeddings, element-wise ops, norms and rotary positions.
    trait CoreOps: MemoryOps {
        /// `sample_rows` (sampling where the logits are).
        op Sample {
            /// One token per row of the `logits` tensors (`[rows, vocab]` f32 each, their rows in order)
            /// drawn under that row's settings in `rows` ([`crate::sampling`]: penalties, bias, the
            /// grammar's mask, temperature, top-k/top-p/min-p, the row's uniform number) → `[rows]` i32:
            /// a decode step reads back one id per sequence, not its logits. The tensors may be the
            /// sequences' separate head outputs; their ids land in one tensor, one download.
            fn sample_rows(&self, logits: &[&Tensor], rows: &[&RowSampling]) -> Result<Tensor>;
        }

        /// `linear` (and `linear_pair`) over f32 / bf16 / f16 weights.
        op LinearDense {
            /// `x [m, k] · wᵀ → [m, n]` for a placed weight `[n, k]` of any dtype.
            fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor>;

            /// `(x·w1ᵀ, x·w2ᵀ)` for two placed weights of one shape (an MLP's gate and up). A backend
            /// may fuse them into one pass over the activations; by default it is two
            /// [`CoreOps::linear`]s.
            fn linear_pair(&self, x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<(Tensor, Tensor)> = {
                Ok((self.linear(x, w1)?, self.linear(x, w2)?))
            };

            /// `x·wᵢᵀ` for several placed weights of `x`'s width (a layer's projections of one input:
            /// Gated DeltaNet's four, attention's q, k and v, the router and the shared expert's gate). A
            /// device may compute them in one pass; by default one [`CoreOps::linear`] each.
            fn linear_many(&self, x: &Tensor, ws: &[&Tensor]) -> Result<Vec<Tensor>> = {
                ws.iter().map(|w| self.linear(x, w)).collect()
            };

            /// SwiGLU's first half: `silu(x·gateᵀ) · (x·upᵀ)` → `[m, n]`, [`CoreOps::linear_pair`] then
            /// [`CoreOps::silu_mul`] (the default; a device may compute both products and the product of
            /// the two in one pass, with their bits).
            fn linear_swiglu(&self, x: &Tensor, gate: &Tensor, up: &Tensor) -> Result<Tensor> = {
                let (mut g, u) = self.linear_pair(x, gate, up)?;
                self.silu_mul(&mut g, &u);
                Ok(g)
            };
        }

        /// `linear` over NVFP4 weights.
        op LinearNvfp4 {}

        /// `embed`.
        op Embed {
            /// Rows `ids` of a placed embedding table, widened to f32.
            fn embed(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor>;
        }

        /// Element-wise ops.
        op Elementwise {
            /// `x += y`.
            fn add(&self, x: &mut Tensor, y: &Tensor);

            /// `x[i] += bias` for every row `i` (`bias [cols]`).
            fn add_bias(&self, x: &mut Tensor, bias: &Tensor);

            /// `x *= s`.
            fn scale(&self, x: &mut Tensor, s: f32);

            /// `gate = silu(gate) · up` (SwiGLU).
            fn silu_mul(&self, gate: &mut Tensor, up: &Tensor);

            /// `x *= sigmoid(gate)`, same shapes (the attention output gate).
            fn sigmoid_mul(&self, x: &mut Tensor, gate: &Tensor);

            /// `out[i] += sigmoid(gate[i]) · y[i]` with one gate per row (`gate [T, 1]`: the shared
            /// expert).
            fn add_sigmoid_gated(&self, out: &mut Tensor, y: &Tensor, gate: &Tensor);

            /// GELU in place: the tanh approximation or the exact erf form.
            fn gelu(&self, x: &mut Tensor, tanh: bool);
        }

        /// Norms.
        op Norms {
            /// RMSNorm over groups of `w.len()` elements (a whole row, or each head when `w` is one head
            /// long): `x̂ · (1 + w)` when `one_plus` (Qwen3.5's zero-centred weights), else `x̂ · w`.
            fn rms_norm(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool);

            /// `x += y`, then the RMSNorm of the sum (as [`CoreOps::rms_norm`] over whole rows) into a new
            /// tensor: a decoder layer's residual add and the next norm, `x` keeping the residual stream.
            /// A device fuses them into one pass over each row; by default it is `add`, a copy and
            /// `rms_norm`.
            fn add_rms_norm(&self, x: &mut Tensor, y: &Tensor, w: &Tensor, eps: f32, one_plus: bool) -> Result<Tensor> = {
                self.add(x, y);
                let mut h = x.clone();
                self.rms_norm(&mut h, w, eps, one_plus);
                Ok(h)
            };

            /// Gated RMSNorm per group of `w.len()`: `x̂ · w · silu(z)`.
            fn rms_norm_gated(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32);

            /// L2 normalisation of each group of `group` elements.
            fn l2_norm(&self, x: &mut Tensor, group: usize, eps: f32);

            /// LayerNorm over rows with weight and bias.
            fn layer_norm(&self, x: &mut Tensor, w: &Tensor, b: &Tensor, eps: f32);
        }

        /// Rotary positions.
        op Rotary {
            /// Rotary tables for positions `[T][t, h, w]` (text positions repeat one value three times).
            /// By default computed where the positions are (the host) and uploaded once per forward.
            fn rope_table(&self, rope: &MRope, positions: &[[i64; 3]]) -> Result<RopeTable> = {
                let half = rope.rot_dim() / 2;
                let mut cos = vec![0f32; positions.len() * half];
                let mut sin = vec![0f32; positions.len() * half];
                for (i, p) in positions.iter().enumerate() {
                    rope.cos_sin(*p, &mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
                }
                let shape = [positions.len(), half];
                Ok(RopeTable { cos: self.upload_f32(&cos, &shape)?, sin: self.upload_f32(&sin, &shape)? })
            };

            /// Partial (m)RoPE on every head of each row `i` of `x`, with row `i` of `table`.
            fn rope(&self, x: &mut Tensor, rope: &MRope, table: &RopeTable);

            /// Per-head RMSNorm of `x` (`w` one head long; `x̂·(1+w)` where `one_plus`) then (m)RoPE with
            /// row `i` of `table` on row `i`, in place: [`CoreOps::rms_norm`] then [`CoreOps::rope`] (the
            /// default; a device does both in one launch with their bits).
            fn rms_norm_rope(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool, rope: &MRope, table: &RopeTable) = {
                self.rms_norm(x, w, eps, one_plus);
                self.rope(x, rope, table);
            };

            /// NeoX rotary on every `head_dim` head of each row with per-row `cos`/`sin`
            /// `[T, head_dim/2]` (the vision tower's 2-D rotary).
            fn rotate_half(&self, x: &mut Tensor, head_dim: usize, cos: &Tensor, sin: &Tensor);
        }
    }

    /// Attention over the paged KV cache, and the vision towers' bidirectional attention.
    trait AttentionOps: CoreOps {
        /// `attention_paged` (and its forms over several sequences of a step, `attention_paged_rows` and
        /// `write_kv`).
        op AttentionPaged {
            /// Causal attention of `q` rows `rows` (tokens `past..past + n` of one sequence) over its
            /// paged K/V, written into the same rows of `out`.
            #[allow(clippy::too_many_arguments)]
            fn attention_paged(&self, q: &Tensor, rows: Range<usize>, kv: PagedView<'_>, past: usize, shape: AttnShape, scale: f32, out: &mut Tensor);

            /// Causal attention for the rows of several sequences of one step (a decode step's), each
            /// [`PagedRows`] rows of `q` over its sequence's paged K/V, into the same rows of `out`: every
            /// sequence's rows exactly what [`AttentionOps::attention_paged`] gives them alone (the
            /// default calls it sequence by sequence; a device runs one launch for all).
            fn attention_paged_rows(&self, q: &Tensor, seqs: &[PagedRows<'_>], shape: AttnShape, scale: f32, out: &mut Tensor) = {
                for s in seqs {
                    self.attention_paged(q, s.rows.clone(), s.kv, s.past, shape, scale, out);
                }
            };

            /// A step's new K and V rows into one KV layer's paged `pool` (see [`PagedView`]), rows of any
            /// number of sequences at once: row `slots[i].0` of `k` and of `v` to pool rows `slots[i].1`
            /// (its K) and `slots[i].1 + page_size` (its V). K is normed per head (`k_norm`: the weight of
            /// one head, eps, the one-plus form) and rotated on the way as
            /// [`CoreOps::rms_norm_rope`] does (`k` itself is not changed). The default norms and rotates a
            /// copy and writes it row by row; a device does it all in one launch with the same bits.
            #[allow(clippy::too_many_arguments)]
            fn write_kv(&self, pool: &mut Tensor, k: &Tensor, v: &Tensor, slots: &[(usize, usize)], page_size: usize, k_norm: (&Tensor, f32, bool), rope: (&MRope, &RopeTable)) -> Result<()> = {
                let mut kr = k.clone();
                self.rms_norm_rope(&mut kr, k_norm.0, k_norm.1, k_norm.2, rope.0, rope.1);
                let row = k.cols();
                for &(src, dst) in slots {
                    self.write_rows(pool, dst * row, &kr, src..src + 1);
                    self.write_rows(pool, (dst + page_size) * row, v, src..src + 1);
                }
                Ok(())
            };
        }

        /// `attention_bidirectional` (vision towers).
        op AttentionBidirectional {
            /// Bidirectional attention over rows `rows` of `q`, `k`, `v` (one image or frame group),
            /// into the same rows of `out`.
            #[allow(clippy::too_many_arguments)]
            fn attention_bidirectional(&self, q: &Tensor, k: &Tensor, v: &Tensor, rows: Range<usize>, shape: AttnShape, scale: f32, out: &mut Tensor);
        }
    }

    /// Recurrent state: Gated DeltaNet's conv and delta rule, advancing per-sequence state tensors.
    trait RecurrentOps: CoreOps {
        /// `causal_conv_silu`, `delta_gates`, `gated_delta` (and their decode forms over several sequences,
        /// `causal_conv_silu_rows` and `gated_delta_rows`; a decode step from the conv's output,
        /// `gated_delta_step`).
        op GatedDeltaNet {
            /// Depthwise causal conv (`w [channels, kernel]`) then silu over rows `rows` of `x`,
            /// continuing from and advancing `state` (the last `kernel − 1` inputs).
            fn causal_conv_silu(&self, x: &Tensor, rows: Range<usize>, w: &Tensor, kernel: usize, state: &mut Tensor) -> Result<Tensor>;

            /// The gates of rows `rows`: `β = sigmoid(b)`, `g = neg_a · softplus(a + dt_bias)`
            /// (`[n, heads]`).
            fn delta_gates(&self, a: &Tensor, b: &Tensor, rows: Range<usize>, neg_a: &Tensor, dt_bias: &Tensor) -> Result<(Tensor, Tensor)>;

            /// The gated delta rule over `n` tokens of one sequence, advancing `state [nv, dk, dv]`: the
            /// recurrent form token by token (decode) or the chunked form (prefill) → `[n, nv·dv]`.
            #[allow(clippy::too_many_arguments)]
            fn gated_delta(&self, shape: GdnShape, recurrent: bool, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: &mut Tensor) -> Result<Tensor>;

            /// A decode step of several sequences at once: row `i` of `x` is one new token of the
            /// sequence whose conv state is `states[i]` → `[rows, channels]`, each row exactly what
            /// [`RecurrentOps::causal_conv_silu`] gives it alone (the default runs that row by row; a
            /// device runs one launch).
            fn causal_conv_silu_rows(&self, x: &Tensor, w: &Tensor, kernel: usize, states: &mut [&mut Tensor]) -> Result<Tensor> = {
                let (n, c) = (x.rows(), x.cols());
                let mut out = self.zeros_f32(&[n, c])?;
                for (i, st) in states.iter_mut().enumerate() {
                    let o = self.causal_conv_silu(x, i..i + 1, w, kernel, st)?;
                    self.write_rows(&mut out, i * c, &o, 0..1);
                }
                Ok(out)
            };

            /// A decode step of several sequences at once: row `i` of `q`, `k`, `v`, `g`, `beta` is one
            /// token (past the first) of the sequence whose state is `states[i]`, by the recurrent rule
            /// → `[rows, nv·dv]`, each row exactly what [`RecurrentOps::gated_delta`] gives it alone.
            #[allow(clippy::too_many_arguments)]
            fn gated_delta_rows(&self, shape: GdnShape, q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, states: &mut [&mut Tensor]) -> Result<Tensor> = {
                let vd = shape.nv * shape.dv;
                let mut out = self.zeros_f32(&[q.rows(), vd])?;
                for (i, st) in states.iter_mut().enumerate() {
                    let row = |t: &Tensor| self.gather_rows(t, &[i]);
                    let o = self.gated_delta(shape, true, &row(q)?, &row(k)?, &row(v)?, &row(g)?, &row(beta)?, st)?;
                    self.write_rows(&mut out, i * vd, &o, 0..1);
                }
                Ok(out)
            };

            /// A decode step from the conv's output `[rows, 2·nk·dk + nv·dv]`, row `i` one token (past the
            /// first) of the sequence whose state is `states[i]`: split into q | k | v, q and k
            /// L2-normalised (eps 1e-6), q scaled by `q_scale`, the gates of rows `rows` of `a` and `b`,
            /// and the recurrent rule → `[rows, nv·dv]`, exactly those ops one after another (the default
            /// runs them; a device fuses them into one launch).
            #[allow(clippy::too_many_arguments)]
            fn gated_delta_step(&self, shape: GdnShape, conv: &Tensor, a: &Tensor, b: &Tensor, rows: Range<usize>, neg_a: &Tensor, dt_bias: &Tensor, q_scale: f32, states: &mut [&mut Tensor]) -> Result<Tensor> = {
                let (kd, vd) = (shape.nk * shape.dk, shape.nv * shape.dv);
                let mut qkv = self.split_cols(conv, 1, &[kd, kd, vd])?.into_iter();
                let mut part = || qkv.next().ok_or_else(|| BackendError::Device("split_cols lost a part: this is a bug".into()));
                let (mut q, mut k, v) = (part()?, part()?, part()?);
                self.l2_norm(&mut q, shape.dk, 1e-6);
                self.l2_norm(&mut k, shape.dk, 1e-6);
                self.scale(&mut q, q_scale);
                let (beta, g) = self.delta_gates(a, b, rows, neg_a, dt_bias)?;
                match states {
                    [one] => self.gated_delta(shape, true, &q, &k, &v, &g, &beta, one),
                    _ => self.gated_delta_rows(shape, &q, &k, &v, &g, &beta, states),
                }
            };
        }
    }

    /// Mixture of experts: the router, and routed experts computed from fixed-stride slots.
    trait ExpertOps: CoreOps {
        /// `route`.
        op Router {
            /// Softmax over each row of router logits, the `k` most probable experts (ties to the lower
            /// id) and their weights, renormalised over the kept `k` when `renorm` (`norm_topk_prob`);
            /// each row's experts in ascending id order. The ids stay a tensor: downloading them is the
            /// layer's one routing sync, which the caller makes explicitly.
            fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing>;
        }

        /// `alloc_expert_pool`, `upload_expert`, `moe_routed`, `moe_routed_on_device`, `moe_combine` (routed
        /// experts in slots).
        op ExpertSlots {
            /// A pool of `slots` fixed-stride expert slots for `layer` (device memory for `slots`
            /// experts).
            fn alloc_expert_pool(&self, layer: u32, slots: usize, shape: ExpertShape) -> Result<ExpertPool>;

            /// Copies `expert` into `slot` of `pool` (replacing what it held) once the work before `after`
            /// — the slot's last reader — has run, and records its key: a device orders its copy after
            /// that work without the host waiting. The returned fence completes when the copy has; the
            /// backend keeps `expert` (and its lease) until then, or, where the slot is the host memory
            /// itself (the CPU), until the slot is reused.
            fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, expert: HostExpert, after: Fence) -> Result<Fence>;

            /// Routed experts on resident slots: for every token `t` and entry `j` with `slots[t, j] ≥
            /// 0`, `partials[t·k + j] = weights[t, j] · down(silu(gate(x_t)) · up(x_t))` of the expert in
            /// that slot; entries with a negative slot (not in this wave) are left as they are. `slots`
            /// is `[T, k]` row-major on the host (the layer built it from the routing it read back: no
            /// backend reads it back again), `weights` `[T, k]` f32, `partials` `[T·k, hidden]`. An
            /// expert runs on all of its wave's tokens at once.
            fn moe_routed(&self, x: &Tensor, slots: &[i32], weights: &Tensor, pool: &ExpertPool, partials: &mut Tensor) -> Result<()>;

            /// `moe_routed` over every entry of `routing` when every expert of the layer is in a slot:
            /// the expert ids stay where the router wrote them (`routing.ids`, as ggml's `MUL_MAT_ID`
            /// takes its ids tensor), mapped to slots by `slot_of` (`[experts]` i32 on the backend, each
            /// expert's slot; the layer uploads it when its slots change). A device reads nothing back
            /// and uploads nothing: the step's routing never reaches the host.
            fn moe_routed_on_device(&self, x: &Tensor, routing: &Routing, slot_of: &Tensor, pool: &ExpertPool, partials: &mut Tensor) -> Result<()>;

            /// `out[t] = 0 + partials[t·k] + partials[t·k + 1] + …` in that order (ascending expert id)
            /// → `[T, hidden]`.
            fn moe_combine(&self, partials: &Tensor, k: usize) -> Result<Tensor>;

            /// [`ExpertOps::moe_combine`], then the shared expert's output `shared` added under its gate
            /// as [`CoreOps::add_sigmoid_gated`] adds it (`gate [T, 1]`): a MoE layer's output. The
            /// default runs the two ops; a device runs one launch with their bits.
            fn moe_combine_shared(&self, partials: &Tensor, k: usize, shared: &Tensor, gate: &Tensor) -> Result<Tensor> = {
                let mut out = self.moe_combine(partials, k)?;
                self.add_sigmoid_gated(&mut out, shared, gate);
                Ok(out)
            };
        }
    }

    /// `qwen4_exp`'s own ops: grouped norms, hyper-connections, PLE and QSA (a family's custom ops,
    /// as candle's `CustomOp`s are: a backend without them refuses that family alone).
    trait Qwen4Ops {
        /// `rms_norm_grouped`, `rms_norm_gated_sigmoid`, `silu`, `sigmoid`.
        op GroupedNorms {
            /// Zero-centred RMSNorm `x̂·(1+w)` per group of `group` columns, `w` over the whole row.
            fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32);

            /// `x = silu(x)` element-wise.
            fn silu(&self, x: &mut Tensor);

            /// `x = sigmoid(x)` element-wise.
            fn sigmoid(&self, x: &mut Tensor);

            /// Gated RMSNorm per group of `w.len()` with a sigmoid gate: `x̂ · w · sigmoid(z)`.
            fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32);
        }

        /// `hc_combine`, `hc_inject` (hyper-connections).
        op HyperConnections {
            /// Hyper-connection input: `mean_s(m_s ⊙ xn_s)`, `m`, `xn` `[n, hc·h]` → `[n, h]`.
            fn hc_combine(&self, m: &Tensor, xn: &Tensor, hc: usize) -> Result<Tensor>;

            /// Hyper-connection output: `x_s += inj_s · out` for each of the `hc` streams of
            /// `x [n, hc·h]`.
            fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize);
        }

        /// `ple_gate`, `causal_conv_dilated_silu` (PLE).
        op Ple {
            /// PLE's gated value per stream: `sigmoid(signed_sqrt(Σ k·q / √h)) · v`, `[n, hc·h]`.
            fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Result<Tensor>;

            /// Causal depthwise conv (no bias) with `dilation`, then silu, from and advancing `state`
            /// `[(kernel−1)·dilation, c]`: `x [n, c]`, `w [c, kernel]`.
            fn causal_conv_dilated_silu(&self, x: &Tensor, w: &Tensor, kernel: usize, dilation: usize, state: &mut Tensor) -> Result<Tensor>;
        }

        /// `mean_rows`, `qsa_select`, `attention_selected` (QSA).
        op AttentionSelected {
            /// Mean of rows `rows` of `x` → `[1, cols]` (summed in row order, then divided by the
            /// count): QSA's pooled block key.
            fn mean_rows(&self, x: &Tensor, rows: Range<usize>) -> Result<Tensor>;

            /// QSA block selection for rows `rows` of `q` (`[·, heads·d]`, normalised and roped), token
            /// indices `past..`: row `j` sees the first `(past + j + 1) / ratio` rows of `keys` (`[≥
            /// blocks, d]`, the complete blocks' keys), scores each `scale · Σ_h max(0, q_h · k)`, and
            /// keeps the `top` best (ties to the lower block), ascending, padded with −1 →
            /// `[rows.len(), top]` i32. The indices stay on the device: [`Qwen4Ops::attention_selected`]
            /// reads them.
            #[allow(clippy::too_many_arguments)]
            fn qsa_select(&self, q: &Tensor, rows: Range<usize>, keys: &Tensor, past: usize, ratio: usize, top: usize, heads: usize, scale: f32) -> Result<Tensor>;

            /// Attention of rows `rows` of `q` (token indices `past..`, `at = (past, ratio)`) over the
            /// positions of each row's selected blocks (`blocks` `[rows.len(), top]` i32 from
            /// [`Qwen4Ops::qsa_select`], −1 unused; block `b` is positions `b·ratio..(b+1)·ratio`) and of
            /// its own incomplete block (`⌊(p+1)/ratio⌋·ratio ..= p`), into the same rows of `out`.
            #[allow(clippy::too_many_arguments)]
            fn attention_selected(&self, q: &Tensor, rows: Range<usize>, kv: PagedView<'_>, blocks: &Tensor, at: (usize, usize), shape: AttnShape, scale: f32, out: &mut Tensor);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table names each method under one op only, so `supports` and the refusal errors are exact.
    #[test]
    fn every_method_belongs_to_one_op() {
        let mut seen = std::collections::HashMap::new();
        for &op in Op::ALL {
            for m in op.methods() {
                assert_eq!(seen.insert(*m, op), None, "{m} is listed twice");
            }
        }
        assert_eq!(Op::LinearNvfp4.group(), "CoreOps");
        assert_eq!(Op::Fences.methods(), &["record_fence", "wait_fence"]);
    }
}
