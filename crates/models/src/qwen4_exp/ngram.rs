//! The per-layer n-gram hash of Qwen3.8-Flash-Next's PLE: which rows of a PLE layer's table each token
//! reads. Pure integer work on token ids (it runs on the host; the rows it names are then gathered on the
//! backend), exactly as transformers 5.23.0's `Qwen4ExpTextNGramEmbedding` computes it.
//!
//! For each n-gram order n = 2..=ngram_size and each of `heads_per_ngram` heads, a token's id is
//! `(t₀·m₀ ⊕ t₋₁·m₁ ⊕ … ⊕ t₋ₙ₊₁·mₙ₋₁) mod V_h + offset_h`, where `t₋ₛ` is the token s positions back,
//! replaced by EOS when an EOS lies in between (n-grams never cross a document boundary) or before the
//! start of the history. The multipliers come from splitmix64 of the seed and the PLE layer's index;
//! each head's table size `V_h` is a distinct prime above `ngram_vocab_size_base - 1`.

/// What the hash needs from the config.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NGramSpec {
    pub vocab_size: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub vocab_base: u64,
    pub seed: u64,
    pub eos: u32,
}

/// One PLE layer's hash: its multipliers and its heads' table ranges.
#[derive(Clone, Debug)]
pub(crate) struct NGramHasher {
    spec: NGramSpec,
    multipliers: Vec<u64>,
    /// Per head: (prime size, row offset in the layer's table).
    heads: Vec<(u64, u64)>,
}

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix64(v: u64) -> u64 {
    let v = v.wrapping_add(GAMMA);
    let v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    v ^ (v >> 31)
}

fn is_prime(v: u64) -> bool {
    if v < 2 {
        return false;
    }
    if v.is_multiple_of(2) {
        return v == 2;
    }
    let mut d = 3;
    while d * d <= v {
        if v.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// The table sizes of the `heads` hash heads of PLE layer `ple_index`: head g of layer ℓ takes the
/// (ℓ·heads + g + 1)-th prime after `vocab_base − 1` (the primes of the earlier layers' heads skipped).
fn head_sizes(vocab_base: u64, heads: usize, ple_index: usize) -> Vec<u64> {
    let mut prime = vocab_base.saturating_sub(1);
    let mut next_prime = || {
        prime += 1;
        while !is_prime(prime) {
            prime += 1;
        }
        prime
    };
    for _ in 0..ple_index * heads {
        next_prime();
    }
    (0..heads).map(|_| next_prime()).collect()
}

/// Rows of PLE layer `ple_index`'s table as transformers sizes it: its `heads` hash heads' primes,
/// padded to a multiple of `pad_to` (`make_ngram_vocab_size_divisible_by`).
pub fn ple_table_rows(vocab_base: u64, heads: usize, ple_index: usize, pad_to: u64) -> u64 {
    let rows: u64 = head_sizes(vocab_base, heads, ple_index).iter().sum();
    rows.div_ceil(pad_to.max(1)) * pad_to.max(1)
}

impl NGramHasher {
    /// The hash of the PLE layer with index `ple_index` (its position in `ple_layer_ids`).
    pub(crate) fn new(spec: NGramSpec, ple_index: usize) -> Self {
        let half_bound = (((1u64 << 63) - 1) / (spec.vocab_size.max(1) as u64) / 2).max(1);
        let base = spec.seed.wrapping_add(10007u64.wrapping_mul(ple_index as u64));
        let multipliers = (0..spec.ngram_size)
            .map(|i| 2 * (splitmix64(base.wrapping_add(GAMMA.wrapping_mul(i as u64 + 1))) % half_bound) + 1)
            .collect();
        let n_heads = (spec.ngram_size - 1) * spec.heads_per_ngram;
        let mut offset = 0;
        let heads = head_sizes(spec.vocab_base, n_heads, ple_index)
            .into_iter()
            .map(|size| {
                let h = (size, offset);
                offset += size;
                h
            })
            .collect();
        NGramHasher { spec, multipliers, heads }
    }

    /// Heads per token (the row ids per token).
    pub(crate) fn heads(&self) -> usize {
        self.heads.len()
    }

    /// Tokens of history a sequence carries between forwards.
    #[cfg(test)]
    pub(crate) fn context(&self) -> usize {
        self.spec.ngram_size - 1
    }

    /// The row ids `[tokens.len() · heads]` of `tokens`, given the `context()` tokens before them
    /// (EOS-filled at the start of a sequence).
    pub(crate) fn row_ids(&self, history: &[u32], tokens: &[u32]) -> Vec<u32> {
        let eos = self.spec.eos;
        let all: Vec<u32> = history.iter().chain(tokens).copied().collect();
        let mut out = Vec::with_capacity(tokens.len() * self.heads.len());
        // The last EOS strictly before each position (None: none).
        let mut last_eos: Option<usize> = None;
        let mut prev_eos = vec![None; all.len()];
        for (t, &tok) in all.iter().enumerate() {
            prev_eos[t] = last_eos;
            if tok == eos {
                last_eos = Some(t);
            }
        }
        for t in history.len()..all.len() {
            let shifted = |s: usize| -> u64 {
                let start = prev_eos[t].map_or(0, |e| e + 1);
                if s == 0 || (t >= s && t - s >= start) {
                    u64::from(all[t - s])
                } else {
                    u64::from(eos)
                }
            };
            for n in 2..=self.spec.ngram_size {
                let mut mixed = shifted(0).wrapping_mul(self.multipliers[0]);
                for s in 1..n {
                    mixed ^= shifted(s).wrapping_mul(self.multipliers[s]);
                }
                let first = (n - 2) * self.spec.heads_per_ngram;
                for &(size, offset) in &self.heads[first..first + self.spec.heads_per_ngram] {
                    out.push((mixed % size + offset) as u32);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> NGramSpec {
        NGramSpec { vocab_size: 1024, ngram_size: 3, heads_per_ngram: 2, vocab_base: 1000, seed: 1234, eos: 994 }
    }

    /// The row ids equal transformers' for the fixture prompts, on both PLE layers (index 0 and 1), for a
    /// one-shot prompt and for the same prompt split in chunks with the history carried over.
    #[test]
    fn row_ids_equal_transformers_in_one_shot_and_in_chunks() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/ref/qwen4_exp-tiny");
        for case in ["text", "long"] {
            let bytes = std::fs::read(dir.join(format!("{case}.safetensors"))).expect("fixture");
            let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
            let i64s = |name: &str| -> Vec<i64> {
                let t = st.tensor(name).expect(name);
                t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
            };
            let ids: Vec<u32> = i64s("input_ids").into_iter().map(|v| v as u32).collect();
            for (ple_index, layer) in [(0usize, 0usize), (1, 2)] {
                let h = NGramHasher::new(spec(), ple_index);
                let want: Vec<u32> = i64s(&format!("ple_ids.{layer}")).into_iter().map(|v| v as u32).collect();
                let fresh = vec![994; h.context()];
                assert_eq!(h.row_ids(&fresh, &ids), want, "{case} layer {layer} one shot");
                for split in [1, 5, ids.len() / 2] {
                    let mut got = h.row_ids(&fresh, &ids[..split]);
                    let mut history = fresh.clone();
                    history.extend_from_slice(&ids[..split]);
                    let history = &history[history.len() - h.context()..];
                    got.extend(h.row_ids(history, &ids[split..]));
                    assert_eq!(got, want, "{case} layer {layer} split at {split}");
                }
            }
        }
    }

    #[test]
    fn heads_take_consecutive_primes_across_layers() {
        let a = NGramHasher::new(spec(), 0);
        let b = NGramHasher::new(spec(), 1);
        assert_eq!(a.heads.iter().map(|h| h.0).collect::<Vec<_>>(), [1009, 1013, 1019, 1021]);
        assert_eq!(b.heads[0].0, 1031);
        assert_eq!(ple_table_rows(1000, 4, 0, 1), 1009 + 1013 + 1019 + 1021);
        assert_eq!(ple_table_rows(1000, 4, 0, 128), 4096);
    }
}
