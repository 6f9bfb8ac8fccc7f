//! Safetensors checkpoints, memory-mapped: one file, or shards listed in `model.safetensors.index.json`.
//!
//! Tensors are handed out as [`Weight`]s that borrow the mapping (no copy) when the data is aligned for its
//! dtype, and own a copy otherwise. Only the header is parsed at open; pages are touched when used.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use osprey_kernels::{DType, WeightRows, WeightView};
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::error::{Error, Result};

#[derive(Clone, Debug)]
struct Entry {
    file: usize,
    dtype: StDtype,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    start: usize,
    end: usize,
}

/// Bytes a weight can borrow from: a memory-mapped file, or a buffer read from disk (an expert).
pub trait ByteSource: AsRef<[u8]> + std::fmt::Debug + Send + Sync {}
impl ByteSource for Mmap {}

/// A tensor in its mapped file (see [`Checkpoint::mapped`]).
#[derive(Clone, Debug)]
pub struct MappedTensor {
    /// Stored dtype.
    pub dtype: StDtype,
    /// Shape.
    pub shape: Vec<usize>,
    map: Arc<dyn ByteSource>,
    start: usize,
}

impl MappedTensor {
    /// `len` bytes from byte `at` of the tensor's data (read from the map: the OS pages them in).
    pub fn bytes(&self, at: usize, len: usize) -> &[u8] {
        &(*self.map).as_ref()[self.start + at..self.start + at + len]
    }
}

/// A tensor's place in a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLocation {
    /// The file.
    pub path: PathBuf,
    /// Stored dtype.
    pub dtype: StDtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute byte offset.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// An opened checkpoint: every tensor name → its file, dtype, shape and byte range.
#[derive(Debug)]
pub struct Checkpoint {
    maps: Vec<Arc<dyn ByteSource>>,
    paths: Vec<PathBuf>,
    entries: HashMap<String, Entry>,
}

/// Storage of a weight: a range of a mapped file, or an owned copy.
#[derive(Clone, Debug)]
enum Storage {
    Mapped {
        map: Arc<dyn ByteSource>,
        start: usize,
        len: usize,
    },
    F32(Arc<Vec<f32>>),
    U16(Arc<Vec<u16>>),
    /// NVFP4: packed codes and e4m3 block scales (each mapped or owned) and the global scale.
    Nvfp4 {
        packed: ByteRange,
        scales: ByteRange,
        global: f32,
    },
}

/// Bytes of a tensor: mapped or owned.
#[derive(Clone, Debug)]
pub(crate) enum ByteRange {
    Mapped { map: Arc<dyn ByteSource>, start: usize, len: usize },
    Owned(Arc<Vec<u8>>),
}

impl ByteRange {
    fn as_slice(&self) -> &[u8] {
        match self {
            ByteRange::Mapped { map, start, len } => &(**map).as_ref()[*start..*start + *len],
            ByteRange::Owned(v) => v,
        }
    }
}

/// A 2-D weight `[rows, cols]` (a Linear's `[out, in]`) in f32, bf16 or f16.
#[derive(Clone, Debug)]
pub struct Weight {
    dtype: DType,
    rows: usize,
    cols: usize,
    storage: Storage,
}

impl Weight {
    /// Builds an owned f32 weight (tests, converted tensors).
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "weight shape: this is a bug");
        Weight { dtype: DType::F32, rows, cols, storage: Storage::F32(Arc::new(data)) }
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Stored element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes of weight data.
    pub fn bytes(&self) -> usize {
        match self.dtype {
            DType::Nvfp4 => self.rows * self.cols / 2 + self.rows * self.cols / 16 + 4,
            d => self.rows * self.cols * d.size(),
        }
    }

    /// An NVFP4 weight from owned parts (`packed [rows, cols/2]`, `scales [rows, cols/16]`).
    pub fn nvfp4(rows: usize, cols: usize, packed: Vec<u8>, scales: Vec<u8>, global: f32) -> Self {
        assert!(packed.len() == rows * cols / 2 && scales.len() == rows * cols / 16, "nvfp4 shapes: this is a bug");
        let storage = Storage::Nvfp4 {
            packed: ByteRange::Owned(Arc::new(packed)),
            scales: ByteRange::Owned(Arc::new(scales)),
            global,
        };
        Weight { dtype: DType::Nvfp4, rows, cols, storage }
    }

    /// NVFP4 parts `(packed, scales, global)`, or `None` for other dtypes.
    pub fn nvfp4_parts(&self) -> Option<(&[u8], &[u8], f32)> {
        match &self.storage {
            Storage::Nvfp4 { packed, scales, global } => Some((packed.as_slice(), scales.as_slice(), *global)),
            _ => None,
        }
    }

    /// A typed view for the kernels.
    pub fn view(&self) -> WeightView<'_> {
        let n = self.rows * self.cols;
        match &self.storage {
            Storage::Nvfp4 { packed, scales, global } => {
                WeightView::Nvfp4 { packed: packed.as_slice(), scales: scales.as_slice(), global: *global }
            }
            Storage::F32(v) => WeightView::F32(v),
            Storage::U16(v) => match self.dtype {
                DType::F16 => WeightView::F16(v),
                _ => WeightView::Bf16(v),
            },
            Storage::Mapped { map, start, len } => {
                let bytes = &(**map).as_ref()[*start..*start + *len];
                // SAFETY: alignment was checked when the Mapped storage was created, the range lies inside
                // the mapping (checked at open) and the length is n elements of the dtype. safetensors data
                // is little-endian, which is the byte order of every target we build for.
                unsafe {
                    match self.dtype {
                        DType::F32 => WeightView::F32(std::slice::from_raw_parts(bytes.as_ptr() as *const f32, n)),
                        DType::BF16 => WeightView::Bf16(std::slice::from_raw_parts(bytes.as_ptr() as *const u16, n)),
                        DType::F16 => WeightView::F16(std::slice::from_raw_parts(bytes.as_ptr() as *const u16, n)),
                        DType::Nvfp4 => unreachable!("nvfp4 weights use Storage::Nvfp4: this is a bug"),
                        DType::U8 | DType::I32 => unreachable!("weights are never U8 or I32: this is a bug"),
                    }
                }
            }
        }
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        self.view().row_f32(r, self.cols, out);
    }

    /// The whole weight widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            self.row_f32(r, &mut out[r * self.cols..(r + 1) * self.cols]);
        }
        out
    }
}

/// Borrows `[start, start+len)` of `buf` when aligned for `dtype`, else copies it (hand-made files).
fn storage_for(buf: &Arc<dyn ByteSource>, dtype: DType, start: usize, len: usize) -> Storage {
    let bytes = &(**buf).as_ref()[start..start + len];
    if (bytes.as_ptr() as usize).is_multiple_of(dtype.size()) {
        return Storage::Mapped { map: buf.clone(), start, len };
    }
    match dtype {
        DType::F32 => Storage::F32(Arc::new(
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        )),
        _ => Storage::U16(Arc::new(bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())),
    }
}

impl Weight {
    /// A dense weight over `[start, start + rows·cols·size)` of a shared buffer (an expert read from disk).
    pub fn from_buffer(dtype: DType, rows: usize, cols: usize, buf: &Arc<dyn ByteSource>, start: usize) -> Self {
        assert!(dtype != DType::Nvfp4, "use Weight::nvfp4_from_buffer: this is a bug");
        Weight { dtype, rows, cols, storage: storage_for(buf, dtype, start, rows * cols * dtype.size()) }
    }

    /// An NVFP4 weight whose codes and scales lie in shared buffers (`(buffer, offset)` each).
    pub fn nvfp4_from_parts(
        (rows, cols): (usize, usize),
        packed: (&Arc<dyn ByteSource>, usize),
        scales: (&Arc<dyn ByteSource>, usize),
        global: f32,
    ) -> Self {
        let packed = ByteRange::Mapped { map: packed.0.clone(), start: packed.1, len: rows * cols / 2 };
        let scales = ByteRange::Mapped { map: scales.0.clone(), start: scales.1, len: rows * cols / 16 };
        Weight { dtype: DType::Nvfp4, rows, cols, storage: Storage::Nvfp4 { packed, scales, global } }
    }
}

fn map_dtype(name: &str, d: StDtype) -> Result<DType> {
    match d {
        StDtype::F32 => Ok(DType::F32),
        StDtype::BF16 => Ok(DType::BF16),
        StDtype::F16 => Ok(DType::F16),
        other => Err(Error::UnsupportedDType { name: name.to_string(), dtype: format!("{other:?}") }),
    }
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else every `*.safetensors` file in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = crate::files::read_small(&index, crate::files::MAX_CONFIG_BYTES)
                .map_err(|source| Error::Io { path: index.clone(), source })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| Error::Json { path: index.clone(), source })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Safetensors { path: index.clone(), reason: "no weight_map".into() })?;
            let mut names: Vec<&str> = map.values().filter_map(|f| f.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let rd = std::fs::read_dir(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
            let mut f: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            f.sort();
            f
        };
        if files.is_empty() {
            return Err(Error::Safetensors { path: dir.to_path_buf(), reason: "no .safetensors files".into() });
        }
        let mut ck = Checkpoint { maps: Vec::new(), paths: Vec::new(), entries: HashMap::new() };
        for path in files {
            ck.add_file(path)?;
        }
        Ok(ck)
    }

    fn add_file(&mut self, path: PathBuf) -> Result<()> {
        let file = File::open(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        // SAFETY: the file is opened read-only; like every mmap-based loader we assume it is not truncated
        // while in use (checkpoints are immutable inputs).
        let map = unsafe { Mmap::map(&file) }.map_err(|source| Error::Io { path: path.clone(), source })?;
        let (header, meta) = SafeTensors::read_metadata(&map[..])
            .map_err(|e| Error::Safetensors { path: path.clone(), reason: e.to_string() })?;
        let base = 8 + header;
        let idx = self.maps.len();
        for (name, info) in meta.tensors() {
            let (s, e) = info.data_offsets;
            if base + e > map.len() || s > e {
                return Err(Error::Safetensors {
                    path: path.clone(),
                    reason: format!("tensor {name} lies past the end of the file"),
                });
            }
            self.entries.insert(
                name,
                Entry { file: idx, dtype: info.dtype, shape: info.shape.clone(), start: base + s, end: base + e },
            );
        }
        self.maps.push(Arc::new(map) as Arc<dyn ByteSource>);
        self.paths.push(path);
        Ok(())
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// All tensor names (sorted).
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Where a tensor's bytes are on disk (the expert store reads them itself).
    pub fn locate(&self, name: &str) -> Result<TensorLocation> {
        let e = self.entry(name)?;
        Ok(TensorLocation {
            path: self.paths[e.file].clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            offset: e.start as u64,
            len: (e.end - e.start) as u64,
        })
    }

    /// Dtype and raw little-endian bytes of a tensor (copying checkpoints).
    pub fn raw(&self, name: &str) -> Result<(StDtype, &[u8])> {
        let e = self.entry(name)?;
        Ok((e.dtype, &(*self.maps[e.file]).as_ref()[e.start..e.end]))
    }

    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        self.entry(name).map(|e| e.shape.as_slice())
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.entries.get(name).ok_or_else(|| Error::MissingTensor { name: name.to_string() })
    }

    fn check_shape(name: &str, e: &Entry, expected: &[usize]) -> Result<()> {
        if e.shape != expected {
            return Err(Error::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: e.shape.clone(),
            });
        }
        Ok(())
    }

    /// A tensor of exactly `shape`, viewed as a 2-D weight `[shape[0], product(rest)]`.
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        let e = self.entry(name)?;
        Self::check_shape(name, e, shape)?;
        let rows = shape.first().copied().unwrap_or(1);
        let cols = shape.iter().skip(1).product();
        self.slice(name, e, 0, rows, cols)
    }

    /// Rows `[row0, row0+rows)` of the 2-D view of a tensor of exactly `shape`, each row `cols` wide
    /// (e.g. one expert's `gate` half out of a fused `gate_up_proj [E, 2I, H]`, viewed as `[E·2I, H]`).
    pub fn weight_rows(&self, name: &str, shape: &[usize], row0: usize, rows: usize, cols: usize) -> Result<Weight> {
        let e = self.entry(name)?;
        Self::check_shape(name, e, shape)?;
        assert!((row0 + rows) * cols <= shape.iter().product(), "weight_rows out of range: this is a bug");
        self.slice(name, e, row0, rows, cols)
    }

    fn slice(&self, name: &str, e: &Entry, row0: usize, rows: usize, cols: usize) -> Result<Weight> {
        let dtype = map_dtype(name, e.dtype)?;
        let size = dtype.size();
        let n: usize = e.shape.iter().product();
        if e.end - e.start != n * size {
            let path = self.paths[e.file].clone();
            return Err(Error::Safetensors {
                path,
                reason: format!("tensor {name} byte length disagrees with its shape"),
            });
        }
        let start = e.start + row0 * cols * size;
        let len = rows * cols * size;
        Ok(Weight { dtype, rows, cols, storage: storage_for(&self.maps[e.file], dtype, start, len) })
    }

    fn bytes_of(&self, name: &str, dtype: StDtype, shape: &[usize]) -> Result<ByteRange> {
        let e = self.entry(name)?;
        Self::check_shape(name, e, shape)?;
        if e.dtype != dtype {
            return Err(Error::UnsupportedDType {
                name: name.to_string(),
                dtype: format!("{:?} (expected {dtype:?})", e.dtype),
            });
        }
        Ok(ByteRange::Mapped { map: self.maps[e.file].clone(), start: e.start, len: e.end - e.start })
    }

    /// A tensor as it lies in its mapped file (dtype, shape, the map and its byte range), for readers
    /// that fetch parts on demand (the PLE table's rows).
    pub fn mapped(&self, name: &str) -> Result<MappedTensor> {
        let e = self.entry(name)?;
        Ok(MappedTensor { dtype: e.dtype, shape: e.shape.clone(), map: self.maps[e.file].clone(), start: e.start })
    }

    fn scalar_f32(&self, name: &str) -> Result<f32> {
        let e = self.entry(name)?;
        if e.shape.iter().product::<usize>() != 1 || e.dtype != StDtype::F32 {
            return Err(Error::ShapeMismatch { name: name.to_string(), expected: vec![], found: e.shape.clone() });
        }
        let b = &(*self.maps[e.file]).as_ref()[e.start..e.start + 4];
        Ok(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The `[out, inp]` weight of the linear layer `prefix`, in whatever format the checkpoint stores it:
    /// dense (`{prefix}.weight` f32/bf16/f16), NVFP4 ModelOpt (`weight` U8 `[out, inp/2]`, `weight_scale`
    /// F8_E4M3 `[out, inp/16]`, `weight_scale_2` F32 scalar; `input_scale` is not needed for weight-only
    /// compute), or compressed-tensors `nvfp4-pack-quantized` (`weight_packed`, `weight_scale`,
    /// `weight_global_scale`, stored inverted). A missing or mis-shaped scale is an error naming it.
    pub fn linear(&self, prefix: &str, out: usize, inp: usize) -> Result<Weight> {
        let w = format!("{prefix}.weight");
        let modelopt = self.entries.get(&w).is_some_and(|e| e.dtype == StDtype::U8);
        let packed_name = format!("{prefix}.weight_packed");
        let ct = self.contains(&packed_name);
        if !modelopt && !ct {
            return self.weight(&w, &[out, inp]);
        }
        if !inp.is_multiple_of(osprey_kernels::nvfp4::BLOCK) {
            return Err(Error::Unsupported(format!("{prefix}: NVFP4 needs input features divisible by 16, got {inp}")));
        }
        let scale_name = format!("{prefix}.weight_scale");
        let (packed, global) = if modelopt {
            (self.bytes_of(&w, StDtype::U8, &[out, inp / 2])?, self.scalar_f32(&format!("{prefix}.weight_scale_2"))?)
        } else {
            let g = self.scalar_f32(&format!("{prefix}.weight_global_scale"))?;
            (self.bytes_of(&packed_name, StDtype::U8, &[out, inp / 2])?, 1.0 / g)
        };
        let scales = self.bytes_of(&scale_name, StDtype::F8_E4M3, &[out, inp / 16])?;
        Ok(Weight { dtype: DType::Nvfp4, rows: out, cols: inp, storage: Storage::Nvfp4 { packed, scales, global } })
    }

    /// A 1-D tensor of `len` elements, widened to f32 (norm weights, A_log, dt_bias).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(self.weight(name, &[len])?.to_f32())
    }
}

impl osprey_backend::HostMatrix for Weight {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn bytes(&self) -> usize {
        Weight::bytes(self)
    }
    fn view(&self) -> WeightView<'_> {
        Weight::view(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write(dir: &Path, file: &str, tensors: &[(&str, StDtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).expect("view")))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).expect("write");
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("osprey-ck-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn dtypes_shards_and_errors_name_the_tensor() {
        let d = tmpdir("shards");
        let f32b: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = [1.0f32, -2.0].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        let i8b = vec![1u8, 2];
        write(&d, "a.safetensors", &[("w", StDtype::F32, vec![2, 2], f32b)]);
        write(&d, "b.safetensors", &[("h", StDtype::F16, vec![2], f16b), ("q", StDtype::I8, vec![2], i8b)]);
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map":{"w":"a.safetensors","h":"b.safetensors","q":"b.safetensors"}}"#,
        )
        .expect("index");
        let ck = Checkpoint::open(&d).expect("open");
        assert_eq!(ck.weight("w", &[2, 2]).expect("w").to_f32(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(ck.vector("h", 2).expect("h"), vec![1.0, -2.0]);
        assert_eq!(ck.weight_rows("w", &[2, 2], 1, 1, 2).expect("row").to_f32(), vec![3.0, 4.0]);
        let e = ck.weight("w", &[4]).expect_err("shape").to_string();
        assert!(e.contains("w") && e.contains("[2, 2]") && e.contains("[4]"), "{e}");
        assert!(ck.weight("nope", &[1]).expect_err("missing").to_string().contains("nope"));
        assert!(ck.weight("q", &[2]).expect_err("dtype").to_string().contains("I8"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn truncated_file_is_refused_naming_the_file() {
        let d = tmpdir("trunc");
        let b: Vec<u8> = vec![0u8; 64];
        write(&d, "model.safetensors", &[("t", StDtype::F32, vec![16], b)]);
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).expect("read");
        std::fs::write(&p, &bytes[..bytes.len() - 10]).expect("truncate");
        let e = Checkpoint::open(&d).expect_err("truncated").to_string();
        assert!(e.contains("model.safetensors"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
