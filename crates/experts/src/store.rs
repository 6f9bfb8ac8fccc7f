//! The expert store: where every routed expert's tensors are on disk, and how to rebuild an expert's
//! weights from the buffers those ranges were read into (no copy: weights borrow the buffers).

use std::path::PathBuf;
use std::sync::Arc;

use osprey_kernels::DType;
use osprey_models::{ByteSource, Checkpoint, ExpertKey, ExpertWeights, Weight};

use crate::reader::{ReadDone, ReadReq};

/// A byte range of one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    /// File index in [`ExpertIndex::files`].
    pub file: usize,
    /// Offset.
    pub offset: u64,
    /// Length.
    pub len: usize,
}

/// One linear of an expert.
#[derive(Clone, Debug)]
pub enum LinearLoc {
    /// bf16 / f16 / f32 rows.
    Dense {
        /// Element type.
        dtype: DType,
        /// `[rows, cols]`.
        shape: (usize, usize),
        /// Bytes.
        at: Range,
    },
    /// NVFP4 codes and scales.
    Nvfp4 {
        /// `[rows, cols]`.
        shape: (usize, usize),
        /// Packed codes.
        packed: Range,
        /// e4m3 block scales.
        scales: Range,
        /// Global scale.
        global: f32,
    },
}

impl LinearLoc {
    fn ranges(&self) -> Vec<Range> {
        match self {
            LinearLoc::Dense { at, .. } => vec![*at],
            LinearLoc::Nvfp4 { packed, scales, .. } => vec![*packed, *scales],
        }
    }
}

/// Every expert's gate, up and down linears.
#[derive(Clone, Debug)]
pub struct ExpertIndex {
    /// Files referenced by ranges.
    pub files: Vec<PathBuf>,
    /// `[layer][expert]` → (gate, up, down); empty for layers without experts.
    pub experts: Vec<Vec<[LinearLoc; 3]>>,
}

fn file_index(files: &mut Vec<PathBuf>, p: &PathBuf) -> usize {
    if let Some(i) = files.iter().position(|f| f == p) {
        return i;
    }
    files.push(p.clone());
    files.len() - 1
}

impl ExpertIndex {
    /// Indexes the Hub-layout experts (`{prefix}.experts.{e}.{gate,up,down}_proj`) of every MoE layer, dense
    /// or NVFP4. `prefixes[layer]` is the layer's `...mlp` prefix.
    pub fn build(
        ck: &Checkpoint,
        prefixes: &[String],
        n_experts: usize,
        hidden: usize,
        inter: usize,
    ) -> osprey_models::Result<Self> {
        let mut files = Vec::new();
        let mut experts = Vec::with_capacity(prefixes.len());
        for p in prefixes {
            let mut layer = Vec::with_capacity(n_experts);
            for e in 0..n_experts {
                let lin = |name: &str,
                           rows: usize,
                           cols: usize,
                           files: &mut Vec<PathBuf>|
                 -> osprey_models::Result<LinearLoc> {
                    let prefix = format!("{p}.experts.{e}.{name}");
                    let w = ck.linear(&prefix, rows, cols)?; // validates shapes, dtypes and scales
                    let mut range = |t: &str| -> osprey_models::Result<Range> {
                        let l = ck.locate(&format!("{prefix}.{t}"))?;
                        Ok(Range { file: file_index(files, &l.path), offset: l.offset, len: l.len as usize })
                    };
                    Ok(match w.nvfp4_parts() {
                        Some((_, _, global)) => {
                            let packed = if ck.contains(&format!("{prefix}.weight_packed")) {
                                range("weight_packed")?
                            } else {
                                range("weight")?
                            };
                            LinearLoc::Nvfp4 { shape: (rows, cols), packed, scales: range("weight_scale")?, global }
                        }
                        None => LinearLoc::Dense { dtype: w.dtype(), shape: (rows, cols), at: range("weight")? },
                    })
                };
                layer.push([
                    lin("gate_proj", inter, hidden, &mut files)?,
                    lin("up_proj", inter, hidden, &mut files)?,
                    lin("down_proj", hidden, inter, &mut files)?,
                ]);
            }
            experts.push(layer);
        }
        Ok(ExpertIndex { files, experts })
    }

    /// The reads one expert needs (all its tensors).
    pub fn reads(&self, key: ExpertKey) -> Vec<ReadReq> {
        self.loc(key)
            .iter()
            .flat_map(LinearLoc::ranges)
            .map(|r| ReadReq { file: r.file, offset: r.offset, len: r.len })
            .collect()
    }

    /// Whether the expert exists (requests and guesses name experts the index may not have).
    pub fn has(&self, key: ExpertKey) -> bool {
        self.experts.get(key.layer()).is_some_and(|l| key.expert() < l.len())
    }

    /// Where the expert's three linears are.
    fn loc(&self, key: ExpertKey) -> &[LinearLoc; 3] {
        &self.experts[key.layer()][key.expert()]
    }

    /// Every expert, layer by layer.
    pub fn keys(&self) -> impl Iterator<Item = ExpertKey> + '_ {
        self.experts.iter().enumerate().flat_map(|(l, e)| (0..e.len()).map(move |e| ExpertKey::new(l, e)))
    }

    /// RAM one resident expert takes: its tensors read into 4 KiB-aligned windows.
    pub fn expert_footprint(&self, key: ExpertKey) -> usize {
        use crate::buf::ALIGN;
        self.loc(key)
            .iter()
            .flat_map(LinearLoc::ranges)
            .map(|r| {
                let start = r.offset as usize / ALIGN * ALIGN;
                (r.offset as usize - start + r.len).div_ceil(ALIGN) * ALIGN
            })
            .sum()
    }

    /// The largest [`ExpertIndex::expert_footprint`] of any expert (`None`: no experts): the stride of
    /// the host arena's slots.
    pub fn largest_footprint(&self) -> Option<usize> {
        self.keys().map(|k| self.expert_footprint(k)).max()
    }

    /// Bytes of one expert's tensors.
    pub fn expert_bytes(&self, key: ExpertKey) -> usize {
        self.loc(key).iter().flat_map(LinearLoc::ranges).map(|r| r.len).sum()
    }

    /// Rebuilds an expert from its reads (in the order of [`ExpertIndex::reads`]); returns the weights and
    /// the bytes of buffer they hold.
    pub fn assemble(&self, key: ExpertKey, done: Vec<ReadDone>) -> (ExpertWeights, usize) {
        let held = done.iter().map(|d| d.buf.len()).sum();
        let parts = done.into_iter().map(|d| (Arc::new(d.buf) as Arc<dyn ByteSource>, d.at)).collect();
        (self.assemble_parts(key, parts), held)
    }

    /// Rebuilds an expert from where each of its ranges (in the order of [`ExpertIndex::reads`]) landed:
    /// a buffer and the offset of the range's bytes in it (the weights borrow the buffers).
    pub fn assemble_parts(&self, key: ExpertKey, parts: Vec<(Arc<dyn ByteSource>, usize)>) -> ExpertWeights {
        let mut it = parts.into_iter();
        let mut next = || it.next().expect("one read per range: this is a bug");
        let mut build = |loc: &LinearLoc| -> Weight {
            match loc {
                LinearLoc::Dense { dtype, shape: (rows, cols), .. } => {
                    let (buf, at) = next();
                    Weight::from_buffer(*dtype, *rows, *cols, &buf, at)
                }
                LinearLoc::Nvfp4 { shape, global, .. } => {
                    let (pb, pa) = next();
                    let (sb, sa) = next();
                    Weight::nvfp4_from_parts(*shape, (&pb, pa), (&sb, sa), *global)
                }
            }
        };
        let [g, u, d] = self.loc(key);
        ExpertWeights { gate: build(g), up: build(u), down: build(d) }
    }
}
