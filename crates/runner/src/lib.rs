//! # osprey-runner — executes batch plans
//!
//! Brief overview: owns the model weights (dense part), every running sequence's state (KV and Gated
//! DeltaNet state) and the sampler, on its own thread. Accepts [`RunnerCommand::Step`] with a `BatchPlan`
//! and replies with the sampled tokens (`StepResult`). All items of a plan run in one batched forward;
//! a prompt chunk receives exactly the vision rows whose placeholders fall inside it (rows come from the
//! vision actor, keyed by media hash, and are held until the sequence's prefill ends).

mod sampler;

use std::collections::HashMap;
use std::sync::Arc;
use std::thread;
use std::time::{SystemTime, UNIX_EPOCH};

use osprey_models::vision::{rows_in_chunk, MediaSpan};
use osprey_models::{KvBlock, LogitsWanted, Model, Positions, SeqInput, SeqState, SeqStep, StateSnapshot};
use osprey_protocol::runner::{BatchPlan, RunnerCommand, Sampled, SnapshotTaken, StepResult};
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_protocol::vision::VisionCommand;
use osprey_protocol::{Handle, Opaque, SeqId};
use tokio::sync::{mpsc, oneshot};

/// The vision actor's inbox (the runner asks it for rows; actor crates do not depend on each other).
pub type VisionSender = mpsc::UnboundedSender<VisionCommand>;

pub use sampler::{sample, Rng};

/// A KV page as the prefix cache holds it (opaque outside the runner).
#[derive(Debug)]
struct Page(KvBlock);

impl Opaque for Page {
    fn bytes(&self) -> usize {
        self.0.bytes()
    }
}

/// A recurrent-state snapshot as the prefix cache holds it.
#[derive(Debug)]
struct Snapshot(StateSnapshot);

impl Opaque for Snapshot {
    fn bytes(&self) -> usize {
        self.0.bytes()
    }
}

/// The runner's own data behind a handle the prefix cache gave back.
fn own<T: 'static>(h: &Handle) -> Option<&T> {
    let any: &dyn std::any::Any = h.as_ref();
    any.downcast_ref::<T>()
}

/// Vision rows of a prompt's media items (shared; `None` until fetched).
type MediaRows = Vec<Option<Arc<Vec<f32>>>>;

struct SeqRec {
    state: SeqState,
    prompt: Arc<PreparedPrompt>,
    /// Prompt tokens followed by generated ones.
    tokens: Vec<u32>,
    sampling: SamplingParams,
    rng: Rng,
    /// Vision rows per media item, fetched on first need, dropped when the prefill ends.
    rows: MediaRows,
    /// Pages `[0, pages_reported)` are in the prefix cache or were sent with an earlier snapshot.
    pages_reported: usize,
}

/// The runner's synchronous core.
pub struct Runner {
    model: Model,
    vision: Option<VisionSender>,
    seqs: HashMap<SeqId, SeqRec>,
    page_size: usize,
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner").field("sequences", &self.seqs.len()).finish()
    }
}

fn clock_seed(seq: SeqId) -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    nanos ^ seq.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Runner {
    /// A runner over a loaded model; `vision` serves media rows (None for text-only models).
    pub fn new(model: Model, vision: Option<VisionSender>, page_size: usize) -> Self {
        Runner { model, vision, seqs: HashMap::new(), page_size: page_size.max(1) }
    }

    /// Sequences held.
    pub fn sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Fetches the vision rows a chunk `[start, end)` of `rec`'s prompt needs.
    fn ensure_rows(vision: Option<&VisionSender>, rec: &mut SeqRec, start: usize, end: usize) -> Result<(), String> {
        for (i, m) in rec.prompt.media.iter().enumerate() {
            let needed = m.spans.iter().any(|&(o, l)| o < end && o + l > start);
            if needed && rec.rows[i].is_none() {
                let v = vision.ok_or("this model has no vision encoder")?;
                let (reply, rx) = oneshot::channel();
                v.send(VisionCommand::Encode { hash: m.hash, patches: m.patches.clone(), reply })
                    .map_err(|_| "the vision encoder is gone".to_string())?;
                let rows = rx.blocking_recv().map_err(|_| "the vision encoder dropped the request".to_string())??;
                rec.rows[i] = Some(rows);
            }
        }
        Ok(())
    }

    /// Executes one plan.
    pub fn step(&mut self, plan: BatchPlan) -> StepResult {
        let mut result = StepResult::default();
        for id in &plan.release {
            self.seqs.remove(id);
        }
        // 1. Admit new sequences and take every scheduled record out of the map (disjoint &mut borrows).
        let mut work: Vec<(usize, SeqRec)> = Vec::new();
        for (k, item) in plan.items.iter().enumerate() {
            if let Some(a) = &item.admit {
                let mut state = self.model.new_state();
                let mut pages_reported = 0;
                if let Some(hit) = &a.prefix {
                    let pages: Option<Vec<&KvBlock>> = hit.pages.iter().map(|p| own::<Page>(p).map(|p| &p.0)).collect();
                    let snap = hit.snapshot.as_ref().and_then(own::<Snapshot>);
                    match pages.zip(snap).map(|(pages, s)| state.restore_prefix(&pages, &s.0)) {
                        Some(Ok(())) => pages_reported = hit.cached_tokens / self.page_size,
                        _ => {
                            result
                                .failed
                                .push((item.seq, "prefix-cache hit without a usable snapshot: this is a bug".into()));
                            continue;
                        }
                    }
                }
                // The snapshot's delta belongs to the sequence that made it; positions are this prompt's.
                state.rope_delta = a.prompt.rope_delta;
                let rng = Rng::new(a.sampling.seed.unwrap_or_else(|| clock_seed(item.seq)));
                let rows = vec![None; a.prompt.media.len()];
                let tokens = a.prompt.input_ids.clone();
                let rec = SeqRec {
                    state,
                    prompt: a.prompt.clone(),
                    tokens,
                    sampling: a.sampling.clone(),
                    rng,
                    rows,
                    pages_reported,
                };
                self.seqs.insert(item.seq, rec);
            }
            match self.seqs.remove(&item.seq) {
                Some(rec) => work.push((k, rec)),
                None => result.failed.push((item.seq, "unknown sequence: this is a bug".into())),
            }
        }
        // 2. Vision rows for prompt chunks.
        let mut ok: Vec<(usize, SeqRec)> = Vec::new();
        for (k, mut rec) in work {
            let item = &plan.items[k];
            let plen = rec.prompt.input_ids.len();
            match Self::ensure_rows(self.vision.as_ref(), &mut rec, item.start, item.end.min(plen)) {
                Ok(()) => ok.push((k, rec)),
                Err(e) => result.failed.push((item.seq, e)),
            }
        }
        // 3. One batched forward.
        let hidden = self.model.info().hidden_size;
        // Rows and prompts are shared (`Arc`), so the spans can borrow copies while states are borrowed mutably.
        let held: Vec<(Arc<PreparedPrompt>, MediaRows)> =
            ok.iter().map(|(_, rec)| (rec.prompt.clone(), rec.rows.clone())).collect();
        let spans: Vec<Vec<MediaSpan<'_>>> = held
            .iter()
            .map(|(prompt, rows)| {
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
            })
            .collect();
        let injected: Vec<_> = ok
            .iter()
            .zip(&spans)
            .map(|((k, _), sp)| rows_in_chunk(sp, plan.items[*k].start, plan.items[*k].end, hidden))
            .collect();
        let outcome = {
            let mut steps: Vec<SeqStep<'_, '_>> = Vec::with_capacity(ok.len());
            for ((k, rec), inj) in ok.iter_mut().zip(&injected) {
                let item = &plan.items[*k];
                let plen = rec.prompt.input_ids.len();
                let positions = match &rec.prompt.positions {
                    Some(p) if item.start < plen => Positions::Explicit(&p[item.start..item.end]),
                    _ => Positions::Text,
                };
                let logits = if item.sample { LogitsWanted::Last } else { LogitsWanted::None };
                let tokens = &rec.tokens[item.start..item.end];
                steps.push(SeqStep {
                    state: &mut rec.state,
                    input: SeqInput { tokens, positions, injected: inj, logits },
                });
            }
            self.model.forward(&mut steps, false)
        };
        drop(injected);
        drop(spans);
        // 4. Sample, record, put the sequences back.
        match outcome {
            Err(e) => {
                for (k, _) in &ok {
                    result.failed.push((plan.items[*k].seq, e.to_string()));
                }
            }
            Ok(out) => {
                for ((k, mut rec), logits) in ok.into_iter().zip(out.logits) {
                    let item = &plan.items[k];
                    if item.snapshot && item.end.is_multiple_of(self.page_size) {
                        let p = self.page_size;
                        let pages = (rec.pages_reported..item.end / p)
                            .map(|i| (i, Arc::new(Page(rec.state.kv_block(i * p, (i + 1) * p))) as Handle))
                            .collect();
                        rec.pages_reported = item.end / p;
                        result.snapshots.push(SnapshotTaken {
                            seq: item.seq,
                            tokens: item.end,
                            pages,
                            snapshot: Arc::new(Snapshot(rec.state.snapshot())),
                        });
                    }
                    if item.sample {
                        let plen = rec.prompt.input_ids.len();
                        let (prompt, output) = rec.tokens.split_at(plen);
                        let (token, logprobs) = sample(&logits, &rec.sampling, prompt, output, &mut rec.rng);
                        rec.tokens.push(token);
                        rec.rows.iter_mut().for_each(|r| *r = None);
                        result.sampled.push(Sampled { seq: item.seq, token, logprobs });
                    }
                    self.seqs.insert(item.seq, rec);
                }
            }
        }
        result
    }
}

/// Starts the runner thread; the scheduler sends it plans.
pub fn spawn(runner: Runner) -> mpsc::UnboundedSender<RunnerCommand> {
    let (tx, mut rx) = mpsc::unbounded_channel::<RunnerCommand>();
    thread::Builder::new()
        .name("osprey-runner".into())
        .spawn(move || {
            let mut runner = runner;
            while let Some(RunnerCommand::Step { plan, reply }) = rx.blocking_recv() {
                let _ = reply.send(runner.step(plan));
            }
        })
        .expect("spawn runner thread");
    tx
}
