//! # osprey-runner — executes batch plans
//!
//! Brief overview: owns the model weights (dense part), every running sequence's state (KV and Gated
//! DeltaNet state) and the sampler, on its own thread. Accepts [`RunnerCommand::Step`] with a `BatchPlan`
//! and replies with the sampled tokens (`StepResult`). All items of a plan run in one batched forward;
//! a prompt chunk receives exactly the vision rows whose placeholders fall inside it (rows come from the
//! vision actor, keyed by media hash, and are held until the sequence's prefill ends).
//!
//! Inside: `driver.rs` (the step: prepare, forward, finish), `seq.rs` (a sequence's record, its grammar
//! mask and chunk positions), `speculative.rs` (drafts and their verification, called by the driver),
//! `sampler.rs`, and `error.rs` (failures as the request sees them).

mod driver;
mod error;
mod sampler;
mod seq;
mod speculative;

use std::sync::Arc;
use std::thread;

use osprey_models::backend::DType;
use osprey_models::{Model, PageRef, StateSnapshot};
use osprey_protocol::prefix::PrefixMatch;
use osprey_protocol::runner::{BatchPlan, RunnerCommand, Sampled, SnapshotTaken, StepResult};
use osprey_protocol::tokenizer::PreparedMedia;
use osprey_protocol::vision::VisionCommand;
use osprey_protocol::{downcast, ErrorCode, Handle, Opaque, RequestError};
use tokio::sync::{mpsc, oneshot};

pub use driver::{Done, Driver, GenerateOptions, Generated, NoMedia, Resume, RowSource, SpeculativeError, Taken, Work};

/// The vision actor's inbox (the runner asks it for rows; actor crates do not depend on each other).
pub type VisionSender = mpsc::UnboundedSender<VisionCommand>;

pub use osprey_protocol::runner::{SpecCounters, MAX_SPECULATIVE_TOKENS};
pub use sampler::{sample, verify, Rng};

/// A KV page as the prefix cache holds it (opaque outside the runner): the pool's page itself, shared.
#[derive(Debug)]
struct Page(PageRef);

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

/// Rows from the vision actor (the server's [`RowSource`]).
struct VisionRows<'a>(Option<&'a VisionSender>);

impl RowSource for VisionRows<'_> {
    fn rows(&mut self, m: &PreparedMedia) -> Result<Arc<Vec<f32>>, RequestError> {
        let gone = |what: &str| RequestError::new(ErrorCode::Unavailable, format!("the vision encoder {what}"));
        let v = self
            .0
            .ok_or_else(|| RequestError::new(ErrorCode::VisionUnsupported, "this model has no vision encoder"))?;
        let (reply, rx) = oneshot::channel();
        let span = tracing::Span::current();
        v.send(VisionCommand::Encode { hash: m.hash, patches: m.patches.clone(), span, reply })
            .map_err(|_| gone("is gone"))?;
        rx.blocking_recv().map_err(|_| {
            // The encoder panicked: `/health` must see it before this failure travels on.
            osprey_protocol::inbox::wait_closed(v);
            gone("dropped the request")
        })?
    }
}

/// The runner's synchronous core: the generation driver plus the protocol around it.
#[derive(Debug)]
pub struct Runner {
    driver: Driver,
    vision: Option<VisionSender>,
    /// The compute device's fault, once it has one: the runner answers the step and stops.
    fault: Option<String>,
}

impl Runner {
    /// A runner over a loaded model with a KV pool of `pages` pages of `page_size` tokens; `vision` serves
    /// media rows (None for text-only models).
    pub fn new(model: Model, vision: Option<VisionSender>, page_size: usize, pages: usize) -> Self {
        Self::with_kv(model, vision, (page_size, pages), DType::F32)
    }

    /// [`Runner::new`] with KV rows kept as `dtype` (f32 or bf16).
    pub fn with_kv(
        model: Model,
        vision: Option<VisionSender>,
        (page_size, pages): (usize, usize),
        dtype: DType,
    ) -> Self {
        Runner { driver: Driver::with_kv(model, page_size, pages, dtype), vision, fault: None }
    }

    /// Decodes with `k` draft tokens per step from the model's draft head (see
    /// [`Driver::with_speculative`]).
    pub fn with_speculative(mut self, k: usize) -> Result<Self, SpeculativeError> {
        self.driver = self.driver.with_speculative(k)?;
        Ok(self)
    }

    /// Page counts of the KV pool.
    pub fn kv_pages(&mut self) -> osprey_protocol::runner::KvPages {
        self.driver.kv_pages()
    }

    /// Sequences held.
    pub fn sequences(&self) -> usize {
        self.driver.sequences()
    }

    /// Executes one plan.
    pub fn step(&mut self, plan: BatchPlan) -> StepResult {
        let mut result = StepResult::default();
        for id in &plan.release {
            self.driver.release(*id);
        }
        for id in &plan.preempt {
            self.driver.preempt(*id);
        }
        // 1. Admit new sequences (restoring prefix-cache hits).
        let mut work = Vec::with_capacity(plan.items.len());
        for item in &plan.items {
            if let Some(a) = &item.admit {
                let resume = match &a.prefix {
                    None => Ok(None),
                    Some(hit) => resume(hit).map(Some),
                };
                let admitted = resume
                    .and_then(|r| self.driver.admit(item.seq, a.prompt.clone(), a.sampling.clone(), r, &a.generated));
                if let Err(e) = admitted {
                    result.failed.push((item.seq, e));
                    continue;
                }
            }
            // The admission is done: the driver takes the chunk.
            work.push(Work { admit: None, ..item.clone() });
        }
        // 2. One batched forward (in a span naming its sequences, which the expert reads inherit), then the
        //    results in protocol form.
        let seqs: Vec<u64> = work.iter().map(|w| w.seq).collect();
        let step = tracing::debug_span!("step", seqs = ?seqs);
        for w in &work {
            step.follows_from(&w.span);
        }
        let done = step.in_scope(|| self.driver.step(&work, &mut VisionRows(self.vision.as_ref())));
        for (seq, res) in done {
            match res {
                Err(e) => {
                    self.driver.release(seq);
                    result.failed.push((seq, e));
                }
                Ok(done) => {
                    if let Some(t) = done.snapshot {
                        result.snapshots.push(SnapshotTaken {
                            seq,
                            tokens: t.tokens,
                            pages: t.pages.into_iter().map(|(i, p)| (i, Arc::new(Page(p)) as Handle)).collect(),
                            snapshot: Arc::new(Snapshot(t.state)),
                        });
                    }
                    for (token, logprobs) in done.sampled {
                        result.sampled.push(Sampled { seq, token, logprobs });
                    }
                }
            }
        }
        // A device that faulted computed nothing this step that can be trusted: every sequence of it
        // fails with the fault (500, naming the op), and the runner stops after answering, so `/health`
        // turns 503 and `serve` exits (docs/reliability.md).
        if let Err(e) = self.driver.model().backend().health() {
            let e = error::backend_error(e);
            tracing::error!(error = %e.message, "the compute device faulted: the runner stops");
            result.sampled.clear();
            result.snapshots.clear();
            result.failed.retain(|(seq, _)| !seqs.contains(seq));
            result.failed.extend(seqs.iter().map(|&s| (s, e.clone())));
            self.fault = Some(e.message);
        }
        result.kv = self.driver.kv_pages();
        result.slots = self.driver.slot_stats();
        result.device = self.driver.device_counters();
        result.family = self.driver.family_metrics();
        result.grammar = self.driver.grammar_counters();
        result.spec = (self.driver.speculative() > 0).then(|| self.driver.spec_counters());
        result
    }
}

/// A prefix-cache hit as the driver takes it: the runner's own pages and snapshot behind the handles.
fn resume(hit: &PrefixMatch) -> Result<Resume<'_>, RequestError> {
    let bug = || {
        RequestError::new(ErrorCode::EngineError, "prefix-cache hit without usable pages or snapshot: this is a bug")
    };
    let pages: Option<Vec<&PageRef>> = hit.pages.iter().map(|p| downcast::<Page>(p).map(|p| &p.0)).collect();
    let snapshot = hit.snapshot.as_ref().and_then(downcast::<Snapshot>).ok_or_else(bug)?;
    Ok(Resume { tokens: hit.cached_tokens, pages: pages.ok_or_else(bug)?, snapshot: &snapshot.0 })
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
                if runner.fault.is_some() {
                    break; // the inbox closes: the scheduler, then `/health`, see the runner gone
                }
            }
        })
        .expect("spawn runner thread");
    tx
}
