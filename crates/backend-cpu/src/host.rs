//! Host implementations of routing and of the ops only the `qwen4_exp` family uses (hyper-connections,
//! PLE, QSA attention, grouped norms). The CPU backend runs them on its tensors in place; the test
//! wrapper [`crate::testing::HostOps`] runs them around another backend through `download` / `upload`,
//! explicitly (the seam has no silent fallbacks). They follow transformers 5.23.0's
//! `modular_qwen4_exp.py` (cited per function).

/// Zero-centred RMSNorm per group of `group` columns, weight `(1 + w)` over the whole row
/// (`Qwen4ExpTextRMSNorm` with `group_size`).
pub fn rms_norm_grouped(x: &mut [f32], w: &[f32], group: usize, eps: f32) {
    let cols = w.len();
    for row in x.chunks_mut(cols) {
        for (g, part) in row.chunks_mut(group).enumerate() {
            let ms = part.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (j, v) in part.iter_mut().enumerate() {
                *v = *v * inv * (1.0 + w[g * group + j]);
            }
        }
    }
}

/// `mean_s(m_s ⊙ xn_s)` over the `hc` streams of each row (`Qwen4ExpTextGatedResidual`'s mixed input):
/// `m`, `xn` `[n, hc·h]` → `[n, h]`.
pub fn hc_combine(m: &[f32], xn: &[f32], hc: usize, h: usize) -> Vec<f32> {
    let n = m.len() / (hc * h);
    let mut out = vec![0f32; n * h];
    for i in 0..n {
        for s in 0..hc {
            let at = i * hc * h + s * h;
            for j in 0..h {
                out[i * h + j] += m[at + j] * xn[at + j];
            }
        }
        for v in &mut out[i * h..(i + 1) * h] {
            *v /= hc as f32;
        }
    }
    out
}

/// `x_s += inj_s · out` for every stream `s` (`hyper_input + injection`): `x [n, hc·h]`, `out [n, h]`,
/// `inj [n, hc]`.
pub fn hc_inject(x: &mut [f32], out: &[f32], inj: &[f32], hc: usize, h: usize) {
    for (i, row) in x.chunks_mut(hc * h).enumerate() {
        for s in 0..hc {
            let w = inj[i * hc + s];
            for j in 0..h {
                row[s * h + j] += w * out[i * h + j];
            }
        }
    }
}

/// PLE's gated value (`Qwen4ExpTextPLELayer.forward`): per stream `g = Σ_j k·q / √h`, then
/// `sign(g)·sqrt(max(|g|, 1e-6))`, and `sigmoid(g) · v` into the stream: `k`, `q` `[n, hc·h]`,
/// `v [n, h]` → `[n, hc·h]`.
pub fn ple_gate(k: &[f32], q: &[f32], v: &[f32], hc: usize, h: usize) -> Vec<f32> {
    let n = v.len() / h;
    let mut out = vec![0f32; n * hc * h];
    for i in 0..n {
        for s in 0..hc {
            let at = i * hc * h + s * h;
            let g = (0..h).map(|j| k[at + j] * q[at + j]).sum::<f32>() / (h as f32).sqrt();
            let g = g.abs().max(1e-6).sqrt()
                * if g > 0.0 {
                    1.0
                } else if g < 0.0 {
                    -1.0
                } else {
                    0.0
                };
            let gate = 1.0 / (1.0 + (-g).exp());
            for j in 0..h {
                out[at + j] = gate * v[i * h + j];
            }
        }
    }
    out
}

/// Causal depthwise conv with dilation and no bias, then silu, continuing from `state` (the last
/// `(kernel−1)·dilation` inputs, oldest first), which it advances: `x [n, c]`, `w [c, kernel]`.
pub fn causal_conv_dilated_silu(
    x: &[f32],
    c: usize,
    w: &[f32],
    kernel: usize,
    dilation: usize,
    state: &mut [f32],
) -> Vec<f32> {
    let n = x.len() / c;
    let past = (kernel - 1) * dilation;
    let mut all = state.to_vec();
    all.extend_from_slice(x);
    let mut out = vec![0f32; n * c];
    for t in 0..n {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += w[ch * kernel + j] * all[(t + j * dilation) * c + ch];
            }
            out[t * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    let keep = all.len() - past * c;
    state.copy_from_slice(&all[keep..]);
    out
}

/// Gated RMSNorm per group of `w.len()` with a sigmoid gate: `x̂ · w · sigmoid(z)` (`Qwen4ExpTextRMSNormGated`
/// with `activation = "sigmoid"`).
pub fn rms_norm_gated_sigmoid(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (row, zr) in x.chunks_mut(d).zip(z.chunks(d)) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((v, &g), &wi) in row.iter_mut().zip(zr).zip(w) {
            *v = *v * inv * wi * (1.0 / (1.0 + (-g).exp()));
        }
    }
}

/// Top-k routing of one token: softmax, the `k` most probable experts (stable sort: ties keep the lower
/// id first), their probabilities renormalised to sum to one when `renorm` (Qwen3.5 always; `qwen4_exp`
/// per `norm_topk_prob`).
pub fn route(logits: &[f32], top_k: usize, renorm: bool) -> (Vec<usize>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let probs: Vec<f32> = exp.iter().map(|e| e / sum).collect();
    let mut idx: Vec<usize> = (0..probs.len()).collect();
    idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    idx.truncate(top_k);
    let top: Vec<f32> = idx.iter().map(|&i| probs[i]).collect();
    if !renorm {
        return (idx, top);
    }
    let s: f32 = top.iter().sum();
    (idx, top.iter().map(|p| p / s).collect())
}

/// [`route`] of every row of `logits` (`cols` wide) as `[T, k]` ids (i32) and weights, each row's
/// experts in ascending id order (the order their outputs are summed in).
pub fn route_sorted(logits: &[f32], cols: usize, top_k: usize, renorm: bool) -> (Vec<i32>, Vec<f32>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in logits.chunks(cols) {
        let (idx, w) = route(row, top_k, renorm);
        let mut pairs: Vec<(usize, f32)> = idx.into_iter().zip(w).collect();
        pairs.sort_by_key(|&(e, _)| e);
        ids.extend(pairs.iter().map(|&(e, _)| e as i32));
        weights.extend(pairs.iter().map(|&(_, w)| w));
    }
    (ids, weights)
}

/// The K and V rows of slot `slot` of one page's K and V planes (`row` values each).
pub fn kv_rows<'a>((k, v): (&'a [f32], &'a [f32]), slot: usize, row: usize) -> (&'a [f32], &'a [f32]) {
    (&k[slot * row..(slot + 1) * row], &v[slot * row..(slot + 1) * row])
}

/// Mean of `n` rows of `cols` values (summed in row order per column, then divided by `n`).
pub fn mean_rows(x: &[f32], n: usize, cols: usize) -> Vec<f32> {
    (0..cols).map(|c| (0..n).map(|t| x[t * cols + c]).sum::<f32>() / n as f32).collect()
}

/// [`osprey_backend::Backend::qsa_select`] on host slices: `q` holds the rows, `keys` at least the
/// blocks the last row sees, `d` values each.
#[allow(clippy::too_many_arguments)]
pub fn qsa_select(
    q: &[f32],
    keys: &[f32],
    (past, ratio, top): (usize, usize, usize),
    heads: usize,
    d: usize,
    scale: f32,
) -> Vec<i32> {
    let n = q.len() / (heads * d);
    let mut out = vec![-1i32; n * top];
    for j in 0..n {
        let complete = (past + j + 1) / ratio;
        let qr = &q[j * heads * d..(j + 1) * heads * d];
        let mut scored: Vec<(f32, usize)> = (0..complete)
            .map(|blk| {
                let kb = &keys[blk * d..(blk + 1) * d];
                let s: f32 = qr.chunks(d).map(|qh| qh.iter().zip(kb).map(|(a, b)| a * b).sum::<f32>().max(0.0)).sum();
                (s * scale, blk)
            })
            .collect();
        // Best first; equal scores keep the lower block first.
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut keep: Vec<usize> = scored.iter().take(top).map(|&(_, blk)| blk).collect();
        keep.sort_unstable();
        for (o, blk) in out[j * top..(j + 1) * top].iter_mut().zip(keep) {
            *o = blk as i32;
        }
    }
    out
}

/// The key positions a QSA row at token index `p` attends to: its selected blocks' (−1 skipped) and its
/// own incomplete block's.
pub fn selected_positions(blocks: &[i32], p: usize, ratio: usize) -> Vec<usize> {
    let mut sel: Vec<usize> =
        blocks.iter().filter(|&&b| b >= 0).flat_map(|&b| b as usize * ratio..(b as usize + 1) * ratio).collect();
    sel.extend((p + 1) / ratio * ratio..=p);
    sel
}

/// Attention of query rows over an explicit set of key positions each (QSA: the selected blocks and the
/// tail), GQA, softmax in f32: `q [rows, heads·hd]` against K/V rows fetched by `kv(pos)`.
pub fn attention_selected<'a>(
    q: &[f32],
    selected: &[Vec<usize>],
    kv: &dyn Fn(usize) -> (&'a [f32], &'a [f32]),
    (heads, kv_heads, hd): (usize, usize, usize),
    scale: f32,
    out: &mut [f32],
) {
    let group = heads / kv_heads;
    for (r, keys) in selected.iter().enumerate() {
        let rows: Vec<(&[f32], &[f32])> = keys.iter().map(|&p| kv(p)).collect();
        for h in 0..heads {
            let kvh = h / group;
            let qv = &q[(r * heads + h) * hd..(r * heads + h + 1) * hd];
            let scores: Vec<f32> =
                rows.iter().map(|(k, _)| osprey_kernels::dot_f32(qv, &k[kvh * hd..(kvh + 1) * hd]) * scale).collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f32 = e.iter().sum();
            let o = &mut out[(r * heads + h) * hd..(r * heads + h + 1) * hd];
            o.fill(0.0);
            for ((_, v), p) in rows.iter().zip(&e) {
                for (oj, vj) in o.iter_mut().zip(&v[kvh * hd..(kvh + 1) * hd]) {
                    *oj += p / sum * vj;
                }
            }
        }
    }
}
