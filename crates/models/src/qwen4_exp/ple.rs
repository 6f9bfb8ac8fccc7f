//! Per-layer n-gram embeddings (`Qwen4ExpTextPLELayer`), added to the streams before a layer's
//! attention hyper-connection: each token's n-gram rows of the layer's table (hashed on the host,
//! [`NGramHasher`]) are concatenated into `e`; `k = norm(key_proj e)` per stream, `v = value_proj e`,
//! `q = norm(streams)`; per stream `g = signed_sqrt(Σ k·q / √h)` gates `v`; the output is the gated value
//! plus `silu(conv(norm(gated value)))`, a causal depthwise conv with dilation `ngram_size` whose last
//! inputs each sequence carries.
//!
//! The table is never loaded: its rows are read on demand from the mapped checkpoint through an LRU row
//! cache under a RAM budget ([`PleTable`]).

use osprey_backend::{Backend, Tensor};

use super::ngram::NGramHasher;
use super::params::Params;
use super::table::PleTable;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::layers::{load_linear, load_vector, Segment};

#[derive(Debug)]
pub(crate) struct Ple {
    pub(crate) hasher: NGramHasher,
    table: PleTable,
    key: Tensor,
    value: Tensor,
    norm_key: Tensor,
    norm_query: Tensor,
    norm_conv: Tensor,
    /// `[hc·hidden, kernel]`.
    conv_w: Tensor,
    kernel: usize,
    dilation: usize,
    hc: usize,
    hidden: usize,
    eps: f32,
}

impl Ple {
    /// Loads `{prefix}` (a layer's `ple`), the layer being PLE layer number `index`.
    pub(crate) fn load(
        b: &dyn Backend,
        ck: &Checkpoint,
        prefix: &str,
        index: usize,
        p: &Params,
        (hidden, eps): (usize, f32),
        ram: (&super::table::PleBudget, &std::sync::Arc<super::table::PleStats>),
    ) -> Result<Self> {
        let hasher = NGramHasher::new(p.ngram, index);
        let head_dim = p.ple_embed_dim / hasher.heads();
        let rows = super::ngram::ple_table_rows(p.ngram.vocab_base, hasher.heads(), index, p.ngram_pad_to);
        let name = format!("{prefix}.ple_embedding");
        let table = PleTable::open(ck, &name, (rows as usize, head_dim), p.ple_layers.len(), ram)?;
        let wide = p.hc * hidden;
        let conv = ck.weight(&format!("{prefix}.conv1d.weight"), &[wide, 1, p.ple_conv_kernel])?.to_f32();
        Ok(Ple {
            hasher,
            table,
            key: load_linear(b, ck, &format!("{prefix}.key_proj"), wide, p.ple_embed_dim)?,
            value: load_linear(b, ck, &format!("{prefix}.value_proj"), hidden, p.ple_embed_dim)?,
            norm_key: load_vector(b, ck, &format!("{prefix}.norm_key.weight"), wide)?,
            norm_query: load_vector(b, ck, &format!("{prefix}.norm_query.weight"), wide)?,
            norm_conv: load_vector(b, ck, &format!("{prefix}.norm_conv.weight"), wide)?,
            conv_w: b.upload_f32(&conv, &[wide, p.ple_conv_kernel])?,
            kernel: p.ple_conv_kernel,
            dilation: p.ngram.ngram_size,
            hc: p.hc,
            hidden,
            eps,
        })
    }

    /// A new sequence's conv state: `[(kernel − 1)·dilation, hc·hidden]` zeros.
    pub(crate) fn new_state(&self, b: &dyn Backend) -> Result<Tensor> {
        Ok(b.zeros_f32(&[(self.kernel - 1) * self.dilation, self.hc * self.hidden])?)
    }

    /// What the layer adds to the streams `x [n, hc·hidden]`, given every row's table rows `row_ids`
    /// (`[n · heads]`, batch order) and each segment's conv state.
    pub(crate) fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        row_ids: &[u32],
        segs: &[Segment],
        states: &mut [&mut Tensor],
    ) -> Result<Tensor> {
        let n = x.rows();
        let width = row_ids.len() / n.max(1) * self.table.cols();
        let e = b.upload_f32(&self.table.rows(row_ids), &[n, width])?;
        let mut k = b.linear(&e, &self.key)?;
        b.rms_norm_grouped(&mut k, &self.norm_key, self.hidden, self.eps);
        let v = b.linear(&e, &self.value)?;
        let mut q = x.clone();
        b.rms_norm_grouped(&mut q, &self.norm_query, self.hidden, self.eps);
        let mut out = b.ple_gate(&k, &q, &v, self.hc)?;
        let mut normed = out.clone();
        b.rms_norm_grouped(&mut normed, &self.norm_conv, self.hidden, self.eps);
        let mut conv = b.zeros_f32(out.shape())?;
        for (seg, st) in segs.iter().zip(states.iter_mut()) {
            let rows: Vec<usize> = (seg.row..seg.row + seg.len).collect();
            let part = b.gather_rows(&normed, &rows)?;
            let c = b.causal_conv_dilated_silu(&part, &self.conv_w, self.kernel, self.dilation, st)?;
            b.write_rows(&mut conv, seg.row * c.cols(), &c, 0..seg.len);
        }
        b.add(&mut out, &conv);
        Ok(out)
    }

    /// Bytes of weights held (the table is not: its rows are cached under their own budget).
    pub(crate) fn bytes(&self) -> usize {
        self.key.bytes() + self.value.bytes() + self.conv_w.bytes()
    }
}
