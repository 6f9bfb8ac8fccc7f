//! `osprey quantize`: a dense checkpoint directory → an NVFP4 ModelOpt-layout directory.
//!
//! Routed experts are quantised by default (the fused layout is split into the Hub's per-expert tensors
//! first); `all_linear` also quantises every decoder linear except the routers, the shared-expert gate,
//! embeddings, `lm_head`, norms, convolutions and the vision tower; `lm_head` adds the (untied) output
//! projection. Each quantised `P.weight` becomes
//! `P.weight` (U8 `[N, K/2]`), `P.weight_scale` (F8_E4M3 `[N, K/16]`), `P.weight_scale_2` (F32 scalar)
//! and `P.input_scale` (F32 scalar 1.0: no activation calibration; weight-only engines ignore it).
//! Everything else is copied byte for byte; tokenizer, template and processor files are copied.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::checkpoint::Checkpoint;
use crate::entry::QuantRules;
use crate::error::{Error, Result};
use crate::quant::quantize_nvfp4;

/// What to quantise.
#[derive(Clone, Copy, Debug, Default)]
pub struct QuantizeOptions {
    /// Every eligible linear, not only routed experts.
    pub all_linear: bool,
    /// `lm_head` too (an untied one): it is read whole for every generated token, as large as all
    /// active experts of a small MoE together; llama.cpp's NVFP4 files quantise it as well.
    pub lm_head: bool,
}

struct Out {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// Quantises `src` into `dst` (created), reporting `(tensors done, tensors)`.
pub fn quantize_dir(
    src: &Path,
    dst: &Path,
    opts: QuantizeOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let rules = &crate::registry::family_for(&crate::config::ModelConfig::from_dir(src)?)?.quant;
    let ck = Checkpoint::open(src)?;
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let names: Vec<String> = ck.names().into_iter().map(str::to_string).collect();
    let mut out: BTreeMap<String, Out> = BTreeMap::new();
    let mut quantized: Vec<String> = Vec::new();
    let quantize = |name: &str, rows: usize, cols: usize, w: &[f32], out: &mut BTreeMap<String, Out>| {
        let q = quantize_nvfp4(w, rows, cols);
        let p = name.trim_end_matches(".weight");
        out.insert(format!("{p}.weight"), Out { dtype: Dtype::U8, shape: vec![rows, cols / 2], data: q.packed });
        out.insert(
            format!("{p}.weight_scale"),
            Out { dtype: Dtype::F8_E4M3, shape: vec![rows, cols / 16], data: q.scales },
        );
        out.insert(
            format!("{p}.weight_scale_2"),
            Out { dtype: Dtype::F32, shape: vec![], data: q.global.to_le_bytes().to_vec() },
        );
        out.insert(
            format!("{p}.input_scale"),
            Out { dtype: Dtype::F32, shape: vec![], data: 1f32.to_le_bytes().to_vec() },
        );
    };
    for (i, name) in names.iter().enumerate() {
        progress(i + 1, names.len());
        let shape = ck.shape(name)?.to_vec();
        let raw = ck.raw(name)?;
        // Fused experts: split into the Hub layout, then quantise each expert.
        let (fused_gate_up, fused_down) = rules.fused_experts;
        if name.ends_with(fused_gate_up) || name.ends_with(fused_down) {
            let (e_n, rows, cols) = (shape[0], shape[1], shape[2]);
            let w = ck.weight(name, &shape)?.to_f32();
            let gate_up = name.ends_with(fused_gate_up);
            // `…mlp.experts.` + e: the per-expert names of the Hub layout.
            let suffix = if gate_up { fused_gate_up } else { fused_down };
            let base =
                format!("{}{}", name.trim_end_matches(suffix), &suffix[..suffix.rfind('.').map_or(0, |i| i + 1)]);
            for e in 0..e_n {
                let m = &w[e * rows * cols..(e + 1) * rows * cols];
                if gate_up {
                    let half = rows / 2;
                    for (k, part) in [("gate_proj", &m[..half * cols]), ("up_proj", &m[half * cols..])] {
                        let n = format!("{base}{e}.{k}.weight");
                        quantize(&n, half, cols, part, &mut out);
                        quantized.push(n);
                    }
                } else {
                    let n = format!("{base}{e}.down_proj.weight");
                    quantize(&n, rows, cols, m, &mut out);
                    quantized.push(n);
                }
            }
            continue;
        }
        let wanted = (rules.is_routed_expert)(name)
            || (opts.all_linear && (rules.eligible_linear)(name, &shape))
            || (opts.lm_head && name == "lm_head.weight");
        if wanted && shape.len() == 2 && shape[1] % 16 == 0 && raw.0 != Dtype::U8 {
            let w = ck.weight(name, &shape)?.to_f32();
            quantize(name, shape[0], shape[1], &w, &mut out);
            quantized.push(name.clone());
        } else {
            out.insert(name.clone(), Out { dtype: raw.0, shape, data: raw.1.to_vec() });
        }
    }
    write_shards(dst, &out)?;
    write_metadata(src, dst, opts, rules, quantized.len())
}

/// The quantised checkpoint's metadata: `config.json` with its `quantization_config`,
/// `hf_quant_config.json`, and the tokenizer, template and processor files copied.
fn write_metadata(src: &Path, dst: &Path, opts: QuantizeOptions, rules: &QuantRules, quantized: usize) -> Result<()> {
    // Metadata: config.json with quantization_config, hf_quant_config.json, and the other files.
    let cfg_path = src.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).map_err(io(&cfg_path))?)
        .map_err(|source| Error::Json { path: cfg_path.clone(), source })?;
    let exclude: Vec<&str> =
        (rules.exclude_modules)(opts.all_linear).into_iter().filter(|m| !(opts.lm_head && *m == "lm_head")).collect();
    let qc = json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude});
    cfg["quantization_config"] = qc.clone();
    let write_json = |p: &Path, v: &serde_json::Value| {
        std::fs::write(p, serde_json::to_string_pretty(v).expect("json") + "\n").map_err(io(p))
    };
    write_json(&dst.join("config.json"), &cfg)?;
    write_json(
        &dst.join("hf_quant_config.json"),
        &json!({"producer": {"name": "osprey", "version": env!("CARGO_PKG_VERSION")},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude,
                                 "quantized_tensors": quantized}}),
    )?;
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "chat_template.json",
        "processor_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "generation_config.json",
    ] {
        let p = src.join(f);
        if p.exists() {
            std::fs::copy(&p, dst.join(f)).map_err(io(&p))?;
        }
    }
    Ok(())
}

/// Writes tensors in shards of at most 2 GiB (one file without an index when it fits).
fn write_shards(dst: &Path, out: &BTreeMap<String, Out>) -> Result<()> {
    const SHARD: usize = 2 << 30;
    let mut shards: Vec<Vec<&String>> = vec![Vec::new()];
    let mut size = 0;
    for (name, t) in out {
        if size + t.data.len() > SHARD && !shards.last().is_some_and(Vec::is_empty) {
            shards.push(Vec::new());
            size = 0;
        }
        size += t.data.len();
        shards.last_mut().expect("non-empty").push(name);
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, names) in shards.iter().enumerate() {
        let file =
            if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        let views: Vec<(String, TensorView<'_>)> = names
            .iter()
            .map(|nm| {
                let t = &out[*nm];
                let v = TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map_err(|e| Error::Safetensors { path: dst.join(&file), reason: format!("{nm}: {e}") })?;
                weight_map.insert((*nm).clone(), file.clone().into());
                Ok(((*nm).clone(), v))
            })
            .collect::<Result<_>>()?;
        let path = dst.join(&file);
        safetensors::serialize_to_file(views, None, &path)
            .map_err(|e| Error::Safetensors { path: path.clone(), reason: e.to_string() })?;
    }
    if n > 1 {
        let idx = json!({"metadata": {}, "weight_map": weight_map});
        let p = dst.join("model.safetensors.index.json");
        std::fs::write(&p, serde_json::to_string_pretty(&idx).expect("json")).map_err(io(&p))?;
    }
    Ok(())
}
