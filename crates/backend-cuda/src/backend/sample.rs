//! Sampling on the device (`kernels/sample.cu`): every row's settings, edits and grammar mask go up in
//! one upload, one launch per logits tensor writes its rows' ids into one `[rows]` tensor, so a decode
//! step reads back one id per sequence in one download whatever the sampling.

use osprey_backend::sampling::{self, RowSampling};
use osprey_backend::{DType, Result, Tensor};

use super::{ptr, u32_of, CudaBackend};
use crate::device::LaunchConfig;
use crate::launch;

/// Words of a row's header in the settings (`SAMPLE_HEADER` in `kernels/sample.cu`).
const HEADER: usize = 12;

/// The kernel's edit flags (`EDIT_*` in `kernels/sample.cu`).
const REPEAT: u32 = 1;
const SUBTRACT: u32 = 2;
const BIAS: u32 = 4;

/// The settings `sample_rows` reads: a 12-word header a row (temperature, top-k, top-p, min-p, the
/// repetition penalty, the edits' count and offset, the mask's offset, length and presence, the uniform
/// number's low and high words), then each row's edits (token, flags, subtract, bias) and mask words.
pub(super) fn pack(rows: &[&RowSampling]) -> Vec<u32> {
    let extra: usize = rows.iter().map(|r| 4 * r.edits.len() + r.allowed.as_ref().map_or(0, Vec::len)).sum();
    let mut w = vec![0u32; HEADER * rows.len()];
    w.reserve(extra);
    for (i, r) in rows.iter().enumerate() {
        let at_edits = w.len();
        for e in &r.edits {
            let flag = |on: bool, f: u32| if on { f } else { 0 };
            let flags = flag(e.repeat, REPEAT) | flag(e.subtract.is_some(), SUBTRACT) | flag(e.bias.is_some(), BIAS);
            let (sub, bias) = (e.subtract.unwrap_or(0.0), e.bias.unwrap_or(0.0));
            w.extend_from_slice(&[e.token, flags, sub.to_bits(), bias.to_bits()]);
        }
        let at_mask = w.len();
        let mask = r.allowed.as_deref().unwrap_or(&[]);
        w.extend_from_slice(mask);
        let u = r.uniform.to_bits();
        w[HEADER * i..HEADER * (i + 1)].copy_from_slice(&[
            r.temperature.to_bits(),
            r.top_k,
            r.top_p.to_bits(),
            r.min_p.to_bits(),
            r.repetition_penalty.to_bits(),
            u32_of(r.edits.len()),
            u32_of(at_edits),
            u32_of(at_mask),
            u32_of(mask.len()),
            u32::from(r.allowed.is_some()),
            u as u32,
            (u >> 32) as u32,
        ]);
    }
    w
}

impl CudaBackend {
    /// [`CoreOps::sample_rows`].
    pub(super) fn sample(&self, logits: &[&Tensor], rows: &[&RowSampling]) -> Result<Tensor> {
        sampling::check_rows(logits, rows)?;
        let out = self.empty(DType::I32, &[rows.len()])?;
        if rows.is_empty() {
            return Ok(out);
        }
        let bytes: Vec<u8> = pack(rows).iter().flat_map(|w| w.to_le_bytes()).collect();
        let params = self.upload_bytes(&bytes)?;
        // Scratch for the widest tensor's rows: its processed logits (f32) and their masses (f64).
        let most = logits.iter().map(|t| t.rows() * t.cols()).max().unwrap_or(0);
        let (y, m) = (self.empty(DType::F32, &[most])?, self.empty(DType::I32, &[2 * most])?);
        let mut first = 0;
        for t in logits {
            let (n, cols) = (t.rows(), t.cols());
            let call = launch::sample_rows(
                ptr(t),
                params.ptr,
                ptr(&y),
                ptr(&m),
                ptr(&out),
                u32_of(n),
                u32_of(cols),
                u32_of(first),
            );
            self.try_run(call, LaunchConfig::per_group(n, 256))?;
            first += n;
        }
        Ok(out)
    }
}
