//! The seam's vocabulary: what a weight is stored as, how activations enter a matmul, and the geometry
//! of the layers' ops. Every backend reads these; the CPU kernels use them too (`osprey-kernels`
//! re-exports them), but they depend on nothing, so a device backend never depends on a kernel crate.

/// How activations enter a matmul.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// f32 activations everywhere (what the parity tests use).
    Exact,
    /// The fast default: NVFP4 matmuls take int8 activations quantised per 16-value block (few rows:
    /// `osprey_kernels::q8`; more, on AVX-512 VNNI or AVX2: `osprey_kernels::q8_gemm`); on CPUs with
    /// AVX512-BF16, bf16 matmuls (and NVFP4 ones of many rows without VNNI) take activations rounded to
    /// bf16 (`osprey_kernels::bf16`); everything else is as `Exact`. A device backend documents its own
    /// reading of it.
    #[default]
    Int8,
}

/// Element type of a stored weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE f32.
    F32,
    /// bfloat16 (stored as raw u16 bits).
    BF16,
    /// IEEE half (stored as raw u16 bits).
    F16,
    /// NVFP4: packed e2m1 pairs with e4m3 block scales and a global scale.
    Nvfp4,
    /// Bytes (packed blobs, masks).
    U8,
    /// 32-bit signed integers (expert slot ids, page tables, selected positions).
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            // Half a byte per value plus one scale byte per 16 values, rounded up to a byte.
            DType::Nvfp4 | DType::U8 => 1,
            DType::I32 => 4,
        }
    }
}

/// Host data on its way to a device ([`crate::Backend::upload`]), typed.
#[derive(Clone, Copy, Debug)]
pub enum HostData<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// f16 bit patterns.
    F16(&'a [u16]),
    /// Bytes.
    U8(&'a [u8]),
    /// 32-bit integers.
    I32(&'a [i32]),
}

impl HostData<'_> {
    /// Its element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::Bf16(_) => DType::BF16,
            HostData::F16(_) => DType::F16,
            HostData::U8(_) => DType::U8,
            HostData::I32(_) => DType::I32,
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::Bf16(v) | HostData::F16(v) => v.len(),
            HostData::U8(v) => v.len(),
            HostData::I32(v) => v.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor's elements brought to the host ([`crate::Backend::download`]).
#[derive(Clone, Debug, PartialEq)]
pub enum HostVec {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// f16 bit patterns.
    F16(Vec<u16>),
    /// Bytes.
    U8(Vec<u8>),
    /// 32-bit integers.
    I32(Vec<i32>),
}

impl HostVec {
    /// Borrowed, as it would be uploaded.
    pub fn as_data(&self) -> HostData<'_> {
        match self {
            HostVec::F32(v) => HostData::F32(v),
            HostVec::Bf16(v) => HostData::Bf16(v),
            HostVec::F16(v) => HostData::F16(v),
            HostVec::U8(v) => HostData::U8(v),
            HostVec::I32(v) => HostData::I32(v),
        }
    }
}

impl HostVec {
    /// Bytes of the elements.
    pub fn bytes(&self) -> usize {
        match self {
            HostVec::F32(v) => 4 * v.len(),
            HostVec::Bf16(v) | HostVec::F16(v) => 2 * v.len(),
            HostVec::U8(v) => v.len(),
            HostVec::I32(v) => 4 * v.len(),
        }
    }
}

/// A tensor's shape and elements in host memory: what a host snapshot keeps of a device tensor
/// ([`crate::Backend::download_host`], [`crate::Backend::upload_host`]).
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Elements.
    pub data: HostVec,
}

impl HostTensor {
    /// Bytes of the elements.
    pub fn bytes(&self) -> usize {
        self.data.bytes()
    }
}

/// A borrowed row-major `[n, k]` weight matrix.
#[derive(Clone, Copy, Debug)]
pub enum WeightView<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// f16 bit patterns.
    F16(&'a [u16]),
    /// NVFP4 rows: `packed [n, k/2]`, `scales [n, k/16]` (e4m3), one global scale.
    Nvfp4 {
        /// Two e2m1 codes per byte, even column in the low nibble.
        packed: &'a [u8],
        /// One e4m3 scale per 16 values.
        scales: &'a [u8],
        /// Tensor-wide scale.
        global: f32,
    },
}

impl WeightView<'_> {
    /// Values held (`rows · cols`).
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(w) => w.len(),
            WeightView::Bf16(w) | WeightView::F16(w) => w.len(),
            WeightView::Nvfp4 { packed, .. } => packed.len() * 2,
        }
    }

    /// Whether it holds no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Head geometry of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple of it).
    pub kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
}

/// Head geometry of one Gated DeltaNet layer.
#[derive(Clone, Copy, Debug)]
pub struct GdnShape {
    /// Key (and query) heads.
    pub nk: usize,
    /// Value heads (a multiple of `nk`).
    pub nv: usize,
    /// Key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
}

impl GdnShape {
    /// Floats in one sequence's recurrent state `[nv, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.nv * self.dk * self.dv
    }
}

/// Precomputed inverse frequencies and the axis each frequency reads.
#[derive(Clone, Debug)]
pub struct MRope {
    inv_freq: Vec<f32>,
    axis: Vec<usize>,
    rot_dim: usize,
    head_dim: usize,
}

impl MRope {
    /// `head_dim·partial_rotary_factor` rotary dims, base `theta`, sections `[t, h, w]` (frequency counts).
    pub fn new(head_dim: usize, rot_dim: usize, theta: f64, section: [usize; 3]) -> Self {
        let half = rot_dim / 2;
        // transformers computes `base ** (arange(0, dim, 2).float() / dim)` in f32.
        let inv_freq = (0..half).map(|f| 1.0f32 / (theta as f32).powf((2 * f) as f32 / rot_dim as f32)).collect();
        let axis = (0..half)
            .map(|f| {
                if f % 3 == 1 && f < 3 * section[1] {
                    1
                } else if f % 3 == 2 && f < 3 * section[2] {
                    2
                } else {
                    0
                }
            })
            .collect();
        MRope { inv_freq, axis, rot_dim, head_dim }
    }

    /// The same rotary (dims, frequencies, sections) for heads of another width (QSA's indexer heads
    /// share the decoder's rotary).
    pub fn with_head_dim(&self, head_dim: usize) -> Self {
        MRope { head_dim, ..self.clone() }
    }

    /// Number of rotated dims at the start of each head.
    pub fn rot_dim(&self) -> usize {
        self.rot_dim
    }

    /// `(cos, sin)` tables of length `rot/2` for one token at `pos = [t, h, w]`.
    pub fn cos_sin(&self, pos: [i64; 3], cos: &mut [f32], sin: &mut [f32]) {
        for f in 0..self.inv_freq.len() {
            let angle = pos[self.axis[f]] as f32 * self.inv_freq[f];
            cos[f] = angle.cos();
            sin[f] = angle.sin();
        }
    }

    /// Dims per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Which position axis (0 T, 1 H, 2 W) each rotary frequency reads.
    pub fn axes(&self) -> &[usize] {
        &self.axis
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_assignment_matches_real_sections() {
        let r = MRope::new(256, 64, 1e7, [11, 11, 10]);
        let s: String = r.axes().iter().map(|&a| ['T', 'H', 'W'][a]).collect();
        assert_eq!(s, "THWTHWTHWTHWTHWTHWTHWTHWTHWTHWTH");
        let tiny = MRope::new(64, 16, 1e7, [3, 3, 2]);
        let s: String = tiny.axes().iter().map(|&a| ['T', 'H', 'W'][a]).collect();
        assert_eq!(s, "THWTHWTH");
    }
}
