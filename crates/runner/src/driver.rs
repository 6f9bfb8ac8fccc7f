//! The generation driver: the one loop that turns prompts into tokens. It admits sequences (fresh, or
//! resumed from a prefix-cache hit), runs chunked prefill with each media item's rows injected into exactly
//! the chunks that hold its placeholders (whether the item began in an earlier chunk or before the hit),
//! decodes, samples and stops. The runner actor drives it one batch plan at a time ([`Driver::step`]);
//! `osprey run` and the bench call [`Driver::generate`] for one sequence, so all three run the same code.
//!
//! It sees the model only through the [`CausalLm`] seam and owns every sequence's state.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use osprey_models::backend::{DType, RowSampling};
use osprey_models::vision::{rows_in_chunk, MediaSpan};
use osprey_models::{
    ForwardOptions, KvPool, LogitsWanted, Model, PageGeometry, PageRef, Positions, SeqInput, SeqStep, StateSnapshot,
};
use osprey_protocol::constraint::TokenMatcher;
use osprey_protocol::runner::{GrammarCounters, KvPages, TokenLogprobs};
use osprey_protocol::scheduler::{FinishReason, Limits, SamplingParams, TokenBudget};
use osprey_protocol::tokenizer::{PreparedMedia, PreparedPrompt};
use osprey_protocol::{ErrorCode, RequestError, SeqId};

use crate::error::{engine_error, grammar_error, model_error, reserve_error};
use crate::sampler::{device_can_draw, row_settings, sample, uniform_for, Rng};
use crate::seq::{chunk_positions, grammar_mask, MediaRows, SeqRec};
use crate::speculative::{self, feed_head, DraftOverride};
use osprey_protocol::runner::{SpecCounters, MAX_SPECULATIVE_TOKENS};

/// Where a sequence's media rows come from: the vision actor in the server, the tower in-process for
/// `osprey run`.
pub trait RowSource {
    /// `[tokens, hidden]` rows of one media item.
    fn rows(&mut self, media: &PreparedMedia) -> Result<Arc<Vec<f32>>, RequestError>;
}

/// A row source for text-only prompts: any media item is an error.
#[derive(Debug, Default)]
pub struct NoMedia;

impl RowSource for NoMedia {
    fn rows(&mut self, _: &PreparedMedia) -> Result<Arc<Vec<f32>>, RequestError> {
        Err(RequestError::new(ErrorCode::VisionUnsupported, "this model has no vision encoder"))
    }
}

/// A prefix-cache hit to resume from: KV pages covering `[0, tokens)` and the recurrent state after them.
#[derive(Debug)]
pub struct Resume<'a> {
    /// Tokens covered (a page multiple).
    pub tokens: usize,
    /// The pages, in order from token 0 (shared with the cache, not copied).
    pub pages: Vec<&'a PageRef>,
    /// State after the pages.
    pub snapshot: &'a StateSnapshot,
}

/// One sequence's chunk in a step: the scheduler's plan item itself (the driver reads its tokens,
/// sampling, snapshot, budget and span; `admit` is the runner's, done before the step, and `None` here).
pub type Work = osprey_protocol::runner::PlanItem;

/// A snapshot taken after a work item.
#[derive(Debug)]
pub struct Taken {
    /// Tokens covered.
    pub tokens: usize,
    /// `(page index, page)` of pages computed since the previous snapshot of this sequence.
    pub pages: Vec<(usize, PageRef)>,
    /// The recurrent state after `tokens`.
    pub state: StateSnapshot,
}

/// What a work item produced.
#[derive(Debug, Default)]
pub struct Done {
    /// The sampled tokens and their logprobs, in order (items with `sample`: one, or with speculation
    /// the accepted drafts and the main model's next token).
    pub sampled: Vec<(u32, Option<TokenLogprobs>)>,
    /// The snapshot (items with `snapshot` ending on a page boundary).
    pub snapshot: Option<Taken>,
}

/// What a preempted sequence keeps: its RNG and grammar position.
#[derive(Debug)]
struct Parked(Rng, Option<Box<dyn TokenMatcher>>);

/// Settings of [`Driver::generate`].
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Prompt tokens per forward.
    pub chunk: usize,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Tokens that end the generation (they are included in the output).
    pub stop_token_ids: Vec<u32>,
}

/// The result of [`Driver::generate`].
#[derive(Clone, Debug)]
pub struct Generated {
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Seconds from the start to the first token (prefill).
    pub prefill_secs: f64,
    /// Seconds of the decode forwards after the first token.
    pub decode_secs: f64,
}

fn clock_seed(seq: SeqId) -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    nanos ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The driver: a model behind the seam, the KV page pool and the sequences it is running.
#[derive(Debug)]
pub struct Driver {
    pub(crate) model: Model,
    pub(crate) pool: KvPool,
    pub(crate) seqs: HashMap<SeqId, SeqRec>,
    page_size: usize,
    /// Sampler states (and grammar positions) of preempted sequences, until they are admitted again (so a
    /// recomputed sequence draws exactly the numbers it would have drawn, in the same grammar state).
    parked: HashMap<SeqId, Parked>,
    /// Ids for [`Driver::generate`]'s private sequences (counting down from the top of the id space).
    next_private: SeqId,
    /// Tokens of KV one sequence may hold (the pool's pages).
    kv_tokens: usize,
    /// Draft tokens per decode step (0: no speculation).
    spec: usize,
    pub(crate) spec_counters: SpecCounters,
    /// Token masks computed since start (collected from the sequences after each step).
    grammar: GrammarCounters,
    pub(crate) draft_override: Option<DraftOverride>,
}

impl Driver {
    /// A driver whose KV pool is bounded only by memory (one-off runs, the bench).
    pub fn new(model: Model, page_size: usize) -> Self {
        Self::with_pool(model, page_size, u32::MAX as usize)
    }

    /// A driver whose KV pool holds `pages` pages of `page_size` tokens (the server: `--kv-capacity-tokens`).
    pub fn with_pool(model: Model, page_size: usize, pages: usize) -> Self {
        Self::with_kv(model, page_size, pages, DType::F32)
    }

    /// [`Driver::with_pool`] with KV rows kept as `dtype` (f32, the exact path, or bf16: half the memory,
    /// `--kv-cache-dtype bf16`).
    pub fn with_kv(model: Model, page_size: usize, pages: usize, dtype: DType) -> Self {
        let page_size = page_size.max(1);
        let geo = PageGeometry::new(model.kv_layout(), page_size).with_dtype(dtype);
        let pool = KvPool::new(geo, pages, model.backend().clone());
        Driver {
            model,
            pool,
            seqs: HashMap::new(),
            page_size,
            parked: HashMap::new(),
            next_private: SeqId::MAX,
            kv_tokens: pages.saturating_mul(page_size),
            spec: 0,
            spec_counters: SpecCounters::default(),
            grammar: GrammarCounters::default(),
            draft_override: None,
        }
    }

    /// Decodes with `k` draft tokens per step from the model's draft head (`--speculative-tokens`;
    /// 0: off). The model must have been loaded with its head.
    pub fn with_speculative(mut self, k: usize) -> Result<Self, SpeculativeError> {
        if k > MAX_SPECULATIVE_TOKENS {
            return Err(SpeculativeError::TooManyDrafts { k, max: MAX_SPECULATIVE_TOKENS });
        }
        if k > 0 && !self.model.has_draft_head() {
            return Err(SpeculativeError::NoDraftHead);
        }
        self.spec = k;
        Ok(self)
    }

    /// Test seam: drafts chosen by `f` (given the sequence's tokens and the drafts so far; `None`: the
    /// head's argmax) instead of the head's argmax, which still runs. A random-weight head accepts almost
    /// nothing, so the acceptance path is tested with drafts that agree where the test says.
    #[doc(hidden)]
    pub fn override_drafts(mut self, f: impl FnMut(&[u32]) -> Option<u32> + Send + 'static) -> Self {
        self.draft_override = Some(DraftOverride(Box::new(f)));
        self
    }

    /// Speculation counters since start.
    pub fn spec_counters(&self) -> SpecCounters {
        self.spec_counters
    }

    /// Draft tokens per decode step (0: no speculation).
    pub fn speculative(&self) -> usize {
        self.spec
    }

    /// The model's expert slot counters.
    pub fn slot_stats(&self) -> osprey_protocol::runner::ExpertSlots {
        self.model.slot_stats()
    }

    /// The compute device's memory and traffic (`None` on a host backend).
    pub fn device_counters(&self) -> Option<osprey_protocol::runner::DeviceCounters> {
        let d = self.model.backend().stats();
        Some(osprey_protocol::runner::DeviceCounters {
            memory_total: d.memory_total?,
            memory_free: d.memory_free.unwrap_or(0),
            bytes_to_device: d.bytes_to_device,
            bytes_from_device: d.bytes_from_device,
            launches: d.launches,
            kernels: d.kernels,
            host_waits: d.host_waits,
            allocations: d.allocations,
            frees: d.frees,
        })
    }

    /// The model family's own metrics, by name.
    pub fn family_metrics(&self) -> Vec<osprey_protocol::runner::FamilyMetric> {
        self.model
            .family_stats()
            .into_iter()
            .map(|s| osprey_protocol::runner::FamilyMetric {
                name: s.name.into(),
                help: s.help.into(),
                counter: s.counter,
                value: s.value,
            })
            .collect()
    }

    /// Page counts of the pool; `shared` counts the running sequences' pages that another holder (the
    /// prefix cache or another sequence) also references.
    pub fn kv_pages(&mut self) -> KvPages {
        let st = self.pool.stats();
        // Only a shared page can be held by two sequences: the pages held, less the repeats among those.
        let held: usize = self.seqs.values().map(|r| r.state.pages().pages().len()).sum();
        let mut shared: Vec<u32> = self
            .seqs
            .values()
            .flat_map(|r| r.state.pages().pages().iter())
            .filter(|p| std::sync::Arc::strong_count(p) > 1)
            .map(|p| p.id())
            .collect();
        let repeats = shared.len();
        shared.sort_unstable();
        shared.dedup();
        let running = held - (repeats - shared.len());
        KvPages { total: st.total, free: st.free, shared: shared.len(), running }
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Sequences held.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Starts a sequence, from a prefix-cache hit when given; `generated` are tokens it produced before
    /// a preemption (fed again after the prompt).
    pub fn admit(
        &mut self,
        seq: SeqId,
        prompt: Arc<PreparedPrompt>,
        sampling: SamplingParams,
        resume: Option<Resume<'_>>,
        generated: &[u32],
    ) -> Result<(), RequestError> {
        let mut state = self.model.new_state_with(self.pool.table()).map_err(model_error)?;
        let mut pages_reported = 0;
        if let Some(r) = resume {
            let b = self.model.backend().clone();
            state.restore_prefix(&r.pages, r.snapshot, b.as_ref()).map_err(model_error)?;
            pages_reported = r.tokens / self.page_size;
        }
        // The snapshot's delta belongs to the sequence that made it; positions are this prompt's.
        state.rope_delta = prompt.rope_delta;
        let Parked(rng, matcher) = self.parked.remove(&seq).unwrap_or_else(|| {
            let rng = Rng::new(sampling.seed.unwrap_or_else(|| clock_seed(seq)));
            Parked(rng, sampling.constraint.as_ref().map(|c| c.grammar.start(c.budget)))
        });
        let rows = vec![None; prompt.media.len()];
        let mut tokens = prompt.input_ids.clone();
        tokens.extend_from_slice(generated);
        let allowed = Vec::new();
        let rec = SeqRec {
            state,
            prompt,
            tokens,
            sampling,
            rng,
            matcher,
            allowed,
            rows,
            pending: None,
            pages_reported,
            masks: GrammarCounters::default(),
        };
        self.seqs.insert(seq, rec);
        Ok(())
    }

    /// Forgets a sequence (finished, cancelled or failed); its pages go back to the pool unless another
    /// holder shares them.
    pub fn release(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.parked.remove(&seq);
    }

    /// Drops a sequence's state to free its pages, keeping its sampler state for its recomputation.
    pub fn preempt(&mut self, seq: SeqId) {
        if let Some(rec) = self.seqs.remove(&seq) {
            self.parked.insert(seq, Parked(rec.rng, rec.matcher));
        }
    }

    /// Fetches the vision rows a chunk `[start, end)` of `rec`'s prompt needs.
    fn ensure_rows(rows: &mut dyn RowSource, rec: &mut SeqRec, start: usize, end: usize) -> Result<(), RequestError> {
        for (i, m) in rec.prompt.media.iter().enumerate() {
            let needed = m.spans.iter().any(|&(o, l)| o < end && o + l > start);
            if needed && rec.rows[i].is_none() {
                rec.rows[i] = Some(rows.rows(m)?);
            }
        }
        Ok(())
    }

    /// Runs one batched forward over `work` (each sequence at most once) and samples. With speculation,
    /// a decode item drafts tokens with the head and is verified in the same forward, so it may emit
    /// several tokens ([`crate::speculative`]). A sequence whose item fails is released. Three parts, as
    /// vLLM v1 splits its step: prepare (records, pages, media rows, drafts), one forward, finish each item
    /// (accept or sample, snapshot).
    pub fn step(&mut self, work: &[Work], rows: &mut dyn RowSource) -> Vec<(SeqId, Result<Done, RequestError>)> {
        let mut out = Vec::with_capacity(work.len());
        let mut ok = self.take(work, rows, &mut out);
        if ok.is_empty() {
            return out;
        }
        let verify_tokens = self.drafts(&mut ok, &mut out);
        let ends: Vec<usize> =
            ok.iter().zip(&verify_tokens).map(|((w, _), v)| v.as_ref().map_or(w.end, |v| w.start + v.len())).collect();
        let (logits, sampled, hidden) = match self.forward(&mut ok, &verify_tokens, &ends) {
            Ok(o) => (o.logits, o.sampled, o.last_hidden),
            Err(e) => {
                let e = model_error(e);
                out.extend(ok.into_iter().map(|(w, _)| (w.seq, Err(e.clone()))));
                return out;
            }
        };
        let mut row0 = 0;
        let items = ok.into_iter().zip(logits.into_iter().zip(sampled)).zip(verify_tokens.into_iter().zip(ends));
        for (((w, rec), (logits, drawn)), (v, end)) in items {
            let rows_of_item = row0;
            row0 += end - w.start;
            let seq = w.seq;
            let head = (&logits[..], drawn);
            out.push((seq, self.finish(w, rec, head, v, hidden.as_ref().map(|h| (h, rows_of_item)))));
        }
        out
    }

    /// Prepare, 1: takes every scheduled record out of the map (disjoint `&mut` borrows), reserves the
    /// pages its chunk needs and fetches its media rows; what fails goes to `out`.
    fn take(
        &mut self,
        work: &[Work],
        rows: &mut dyn RowSource,
        out: &mut Vec<(SeqId, Result<Done, RequestError>)>,
    ) -> Vec<(Work, SeqRec)> {
        let mut ok = Vec::new();
        for w in work {
            let Some(mut rec) = self.seqs.remove(&w.seq) else {
                out.push((w.seq, Err(engine_error("unknown sequence: this is a bug"))));
                continue;
            };
            let plen = rec.prompt.input_ids.len();
            if w.start >= w.end || w.end > rec.tokens.len() || w.start != rec.state.len() {
                out.push((w.seq, Err(engine_error("work out of order with the sequence: this is a bug"))));
                continue;
            }
            if let Err(e) = self.pool.reserve(rec.state.pages_mut(), w.end) {
                out.push((w.seq, Err(reserve_error(e))));
                continue;
            }
            let fetched = w.span.in_scope(|| {
                tracing::debug!(start = w.start, end = w.end, sample = w.sample, "chunk");
                Self::ensure_rows(rows, &mut rec, w.start, w.end.min(plen))
            });
            match fetched {
                Ok(()) => ok.push((w.clone(), rec)),
                Err(e) => out.push((w.seq, Err(e))),
            }
        }
        ok
    }

    /// Prepare, 2: drafts for the decode items, each with the pages its verification needs when the pool
    /// has them to spare (after every item's own pages: the scheduler planned those). Per item, the tokens
    /// to verify (`None`: no draft). A failed draft fails its items (moved to `out`).
    fn drafts(
        &mut self,
        ok: &mut Vec<(Work, SeqRec)>,
        out: &mut Vec<(SeqId, Result<Done, RequestError>)>,
    ) -> Vec<Option<Vec<u32>>> {
        let ks: Vec<usize> = ok
            .iter_mut()
            .map(|(w, rec)| {
                if self.spec == 0 || !speculative::eligible(rec, (w.start, w.end), w.sample, w.snapshot) {
                    return 0;
                }
                let most = self.spec.min(w.budget.saturating_sub(1));
                (1..=most).rev().find(|k| self.pool.reserve(rec.state.pages_mut(), w.end + k).is_ok()).unwrap_or(0)
            })
            .collect();
        let mut verify_tokens: Vec<Option<Vec<u32>>> = vec![None; ok.len()];
        if ks.iter().all(|&k| k == 0) {
            return verify_tokens;
        }
        let mut recs: Vec<&mut SeqRec> = ok.iter_mut().zip(&ks).filter(|(_, &k)| k > 0).map(|((_, r), _)| r).collect();
        let spec_ks: Vec<usize> = ks.iter().copied().filter(|&k| k > 0).collect();
        match speculative::draft(&self.model, &mut recs, &spec_ks, self.draft_override.as_mut()) {
            Ok(drafted) => {
                let mut drafted = drafted.into_iter();
                for (slot, _) in verify_tokens.iter_mut().zip(&ks).filter(|(_, &k)| k > 0) {
                    *slot = drafted.next();
                }
                verify_tokens
            }
            Err(e) => {
                let (failed, kept): (Vec<_>, Vec<_>) =
                    std::mem::take(ok).into_iter().zip(ks).partition(|(_, k)| *k > 0);
                out.extend(failed.into_iter().map(|((w, _), _)| (w.seq, Err(e.clone()))));
                *ok = kept.into_iter().map(|(x, _)| x).collect();
                vec![None; ok.len()]
            }
        }
    }

    /// The one batched forward: each item's tokens (its chunk, or its verified drafts up to `ends`) with
    /// its media rows and positions. Rows and prompts are shared (`Arc`), so the spans can borrow copies
    /// while states are borrowed mutably.
    fn forward(
        &mut self,
        ok: &mut [(Work, SeqRec)],
        verify_tokens: &[Option<Vec<u32>>],
        ends: &[usize],
    ) -> osprey_models::Result<osprey_models::ForwardOutput> {
        let hidden = self.model.info().hidden_size;
        let held: Vec<(Arc<PreparedPrompt>, MediaRows)> =
            ok.iter().map(|(_, rec)| (rec.prompt.clone(), rec.rows.clone())).collect();
        let spans: Vec<Vec<MediaSpan<'_>>> = held.iter().map(|(p, r)| media_spans(p, r, hidden)).collect();
        let injected: Vec<_> =
            ok.iter().zip(&spans).zip(ends).map(|(((w, _), sp), &e)| rows_in_chunk(sp, w.start, e, hidden)).collect();
        let positions: Vec<Option<Vec<[i64; 3]>>> =
            ok.iter().zip(ends).map(|((w, rec), &e)| chunk_positions(&rec.prompt, w.start, e)).collect();
        let verify: Vec<bool> = verify_tokens.iter().map(Option::is_some).collect();
        let draws = self.device_draws(ok, verify_tokens);
        let mut steps: Vec<SeqStep<'_, '_>> = Vec::with_capacity(ok.len());
        for (((((w, rec), inj), pos), v), d) in
            ok.iter_mut().zip(&injected).zip(&positions).zip(verify_tokens).zip(&draws)
        {
            let positions = pos.as_deref().map_or(Positions::Text, Positions::Explicit);
            let (tokens, logits) = match (v, d) {
                (Some(v), _) => (&v[..], LogitsWanted::All),
                (None, Some(d)) => (&rec.tokens[w.start..w.end], LogitsWanted::Sample(d)),
                (None, None) if w.sample => (&rec.tokens[w.start..w.end], LogitsWanted::Last),
                (None, None) => (&rec.tokens[w.start..w.end], LogitsWanted::None),
            };
            steps.push(SeqStep { state: &mut rec.state, input: SeqInput { tokens, positions, injected: inj, logits } });
        }
        let opts = ForwardOptions { keep_hidden: self.spec > 0, verify: &verify, ..ForwardOptions::default() };
        // A step of one new token per sequence, text only, is a decode step: a device that replays graphs
        // records its first and replays those after, keyed by the sequences' count.
        let decode =
            steps.iter().all(|s| s.input.tokens.len() == 1 && s.input.injected.is_empty()) && verify.iter().all(|v| !v);
        let b = self.model.backend().clone();
        if decode {
            b.begin_step(steps.len() as u64)?;
        }
        let out = self.model.forward_with(&mut steps, &opts);
        if decode {
            // After a failed forward the step's recorded work still runs (it only reads and writes this
            // step's buffers); the forward's error is the one reported.
            let ended = b.end_step();
            return out.and_then(|o| ended.map(|()| o).map_err(Into::into));
        }
        out
    }

    /// Per item, the settings of a draw the device makes where the logits are (one id per sequence comes
    /// back instead of its logits): on a device, for a sampling item that is not verifying drafts and
    /// wants no logprobs. The grammar's mask is taken now and the draw's number drawn now, as the host
    /// sampler would after the forward; a mask that fails leaves the item to the host, which reports it.
    fn device_draws(&self, ok: &mut [(Work, SeqRec)], verify_tokens: &[Option<Vec<u32>>]) -> Vec<Option<RowSampling>> {
        let on_device = self.model.backend().device() != osprey_models::backend::Device::Cpu;
        ok.iter_mut()
            .zip(verify_tokens)
            .map(|((w, rec), v)| {
                if !on_device || !w.sample || v.is_some() || !device_can_draw(&rec.sampling) {
                    return None;
                }
                let allowed = grammar_mask(rec).ok()?;
                let plen = rec.prompt.input_ids.len();
                let uniform = uniform_for(&rec.sampling, &mut rec.rng);
                let allowed = allowed.then_some(&rec.allowed[..]);
                Some(row_settings(&rec.sampling, rec.tokens.split_at(plen), allowed, uniform))
            })
            .collect()
    }

    /// Finish one item: accept its verified drafts, or feed the draft head, snapshot and sample; the
    /// sequence goes back into the map unless it failed. `hidden`: the batch's final hidden rows and the
    /// first of this item's.
    fn finish(
        &mut self,
        w: Work,
        mut rec: SeqRec,
        (logits, drawn): (&[f32], Option<u32>),
        verify: Option<Vec<u32>>,
        hidden: Option<(&osprey_models::backend::Tensor, usize)>,
    ) -> Result<Done, RequestError> {
        let mut done = Done::default();
        if let (Some(v), Some((h, row))) = (verify.as_deref(), hidden) {
            done.sampled = speculative::accept(&self.model, &mut rec, (logits, v), (h, row), &mut self.spec_counters)?;
            rec.rows.iter_mut().for_each(|r| *r = None);
            self.collect_masks(&mut rec);
            self.seqs.insert(w.seq, rec);
            return Ok(done);
        }
        if let Some((h, row)) = hidden {
            feed_head(&self.model, &mut rec, (w.start, w.end), h, row)?;
        }
        let p = self.page_size;
        if w.snapshot && w.end.is_multiple_of(p) {
            // A host snapshot that cannot be taken (no room to download) only costs the cache an entry.
            match rec.state.snapshot(self.model.backend().as_ref()) {
                Ok(state) => {
                    let pages = (rec.pages_reported..w.end / p).map(|i| (i, rec.state.full_page(i))).collect();
                    rec.pages_reported = w.end / p;
                    done.snapshot = Some(Taken { tokens: w.end, pages, state });
                }
                Err(e) => tracing::warn!(seq = ?w.seq, error = %e, "prefix snapshot skipped"),
            }
        }
        if w.sample {
            let (token, logprobs) = match drawn {
                Some(token) => (token, None),
                None => {
                    let allowed = grammar_mask(&mut rec)?;
                    let (prompt, output) = rec.tokens.split_at(rec.prompt.input_ids.len());
                    sample(logits, &rec.sampling, prompt, output, &mut rec.rng, allowed.then_some(&rec.allowed[..]))
                }
            };
            if let Some(m) = rec.matcher.as_mut() {
                m.commit(token).map_err(|e| grammar_error(&e))?;
            }
            rec.tokens.push(token);
            rec.rows.iter_mut().for_each(|r| *r = None);
            done.sampled = vec![(token, logprobs)];
        }
        self.collect_masks(&mut rec);
        self.seqs.insert(w.seq, rec);
        Ok(done)
    }

    /// Moves a sequence's mask counters into the driver's totals.
    fn collect_masks(&mut self, rec: &mut SeqRec) {
        let m = std::mem::take(&mut rec.masks);
        self.grammar.masks += m.masks;
        self.grammar.nanos += m.nanos;
    }

    /// Token masks computed since start, and their time.
    pub fn grammar_counters(&self) -> GrammarCounters {
        self.grammar
    }

    /// One sequence from prompt to its last token: prefill in chunks of `opts.chunk`, then decode until a
    /// stop token or its budget (`opts.max_tokens`, bounded by the model's context and the pool, refused
    /// as `context_length_exceeded` when the prompt fills them: `Limits::budget`, the server's rule). The sequence is released at the end.
    pub fn generate(
        &mut self,
        prompt: Arc<PreparedPrompt>,
        sampling: SamplingParams,
        opts: &GenerateOptions,
        rows: &mut dyn RowSource,
    ) -> Result<Generated, RequestError> {
        self.generate_observed(prompt, sampling, opts, rows, &mut || {})
    }

    /// [`Driver::generate`], calling `at_first_token` between the prefill and the decode (where a
    /// benchmark samples its counters); its time counts in neither phase.
    pub fn generate_observed(
        &mut self,
        prompt: Arc<PreparedPrompt>,
        sampling: SamplingParams,
        opts: &GenerateOptions,
        rows: &mut dyn RowSource,
        at_first_token: &mut dyn FnMut(),
    ) -> Result<Generated, RequestError> {
        let seq = self.next_private;
        self.next_private -= 1;
        let plen = prompt.input_ids.len();
        if plen == 0 {
            return Err(RequestError::new(ErrorCode::InvalidRequest, "the prompt is empty"));
        }
        let limits = Limits { context_len: self.model.info().max_position_embeddings, kv_tokens: self.kv_tokens };
        let budget = limits.budget(plen, Some(opts.max_tokens))?;
        self.admit(seq, prompt, sampling, None, &[])?;
        let result =
            self.generate_admitted(seq, plen, (budget, &opts.stop_token_ids, opts.chunk), rows, at_first_token);
        self.release(seq);
        result
    }

    fn generate_admitted(
        &mut self,
        seq: SeqId,
        plen: usize,
        (budget, stop_token_ids, chunk): (TokenBudget, &[u32], usize),
        rows: &mut dyn RowSource,
        at_first_token: &mut dyn FnMut(),
    ) -> Result<Generated, RequestError> {
        let t0 = Instant::now();
        let mut tokens = Vec::new();
        let mut start = 0;
        // (time to the first token, start of the decode)
        let mut first: Option<(f64, Instant)> = None;
        let finish = 'gen: loop {
            let end = if start < plen { (start + chunk.max(1)).min(plen) } else { start + 1 };
            let span = tracing::Span::current();
            let left = budget.left(tokens.len());
            let work = Work { seq, admit: None, start, end, sample: end >= plen, snapshot: false, budget: left, span };
            let (_, res) = self.step(&[work], rows).pop().expect("one result per work item");
            let sampled = res?.sampled;
            if sampled.is_empty() {
                start = end;
                continue;
            }
            if first.is_none() {
                let ttft = t0.elapsed().as_secs_f64();
                at_first_token();
                first = Some((ttft, Instant::now()));
            }
            // A speculative step may emit several tokens; what follows a stop or the budget is dropped.
            for (token, _) in sampled {
                tokens.push(token);
                if let Some(reason) = budget.check_stop(tokens.len(), token, stop_token_ids) {
                    break 'gen reason;
                }
            }
            // The last token is sampled, not fed: the sequence's state ends just before it.
            start = plen + tokens.len() - 1;
        };
        let (prefill_secs, decode_start) = first.expect("the loop ends after a sampled token");
        Ok(Generated { tokens, finish, prefill_secs, decode_secs: decode_start.elapsed().as_secs_f64() })
    }
}

/// Why speculative decoding cannot be turned on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpeculativeError {
    /// More drafts per step than the runner takes.
    #[error("--speculative-tokens is at most {max}, not {k}")]
    TooManyDrafts {
        /// Asked for.
        k: usize,
        /// The most.
        max: usize,
    },
    /// The model has no draft head, or was loaded without it.
    #[error("speculative decoding needs a checkpoint with a draft head (mtp.*), loaded with it")]
    NoDraftHead,
}

/// The rows of each placeholder run of a prompt's media items that have been fetched.
fn media_spans<'a>(prompt: &PreparedPrompt, rows: &'a MediaRows, hidden: usize) -> Vec<MediaSpan<'a>> {
    let mut v = Vec::new();
    for (m, rows) in prompt.media.iter().zip(rows) {
        let Some(rows) = rows else { continue };
        let mut at = 0;
        for &(o, l) in &m.spans {
            v.push(MediaSpan { offset: o, rows: &rows[at * hidden..(at + l) * hidden] });
            at += l;
        }
    }
    v
}
