//! The CPU's core tensor ops: matmuls through `osprey-kernels` (the SIMD path picked at run time),
//! embeddings, element-wise ops, norms and rotary positions.

use super::*;

impl CoreOps for CpuBackend {
    fn sample_rows(&self, logits: &[&Tensor], rows: &[&RowSampling]) -> Result<Tensor> {
        sampling::check_rows(logits, rows)?;
        let each = logits.iter().flat_map(|t| host(t).chunks(t.cols().max(1)).take(t.rows()));
        let ids: Vec<i32> = each.zip(rows).map(|(row, s)| sampling::sample_row(row, s) as i32).collect();
        self.upload(HostData::I32(&ids), &[ids.len()])
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
        zip_apply(host_mut(gate), host(up), |a, b| *a = silu(*a) * b);
    }

    fn sigmoid_mul(&self, x: &mut Tensor, gate: &Tensor) {
        zip_apply(host_mut(x), host(gate), |a, g| *a *= sigmoid(g));
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
}

/// `f(a[i], b[i])` for every element: across the kernels' pool from [`ZIP_PARALLEL`] elements (a
/// prefill's gated activations, each an `exp`: ~2% of a 512-token prefill, serial, with the pool's other
/// threads waiting), on the calling thread below it (decode, a routed expert's few rows). The same
/// arithmetic per element either way.
fn zip_apply(a: &mut [f32], b: &[f32], f: impl Fn(&mut f32, f32) + Sync) {
    const ZIP_PARALLEL: usize = 1 << 16;
    const CHUNK: usize = 1 << 14;
    if a.len() < ZIP_PARALLEL {
        a.iter_mut().zip(b).for_each(|(x, &y)| f(x, y));
        return;
    }
    osprey_kernels::pool::chunks_mut(a, CHUNK, |c, part| {
        part.iter_mut().zip(&b[c * CHUNK..]).for_each(|(x, &y)| f(x, y));
    });
}
