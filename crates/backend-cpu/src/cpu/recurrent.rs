//! The CPU's Gated DeltaNet ops: the causal conv, the gates, and the delta rule (recurrent for decode,
//! chunked for prefill).

use super::*;

impl RecurrentOps for CpuBackend {
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
}
