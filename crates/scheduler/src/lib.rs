//! # osprey-scheduler — continuous batching with chunked prefill
//!
//! Brief overview: owns the waiting and running queues and the token budget. Accepts
//! [`SchedulerCommand`]s (submit, cancel, stats); each step it builds a `BatchPlan`, sends it to the
//! runner, and turns the `StepResult` into per-request `EngineEvent`s. The logic is the synchronous
//! [`Scheduler`] core; [`spawn`] wraps it in a thread. A request whose event receiver is dropped (the
//! client left) is cancelled at the next step and its state released.

mod core;

use std::thread;

use osprey_protocol::prefix::{InsertRequest, MatchRequest, PrefixCommand, PrefixMatch};
use osprey_protocol::runner::RunnerCommand;
use osprey_protocol::scheduler::SchedulerCommand;
use tokio::sync::{mpsc, oneshot};

pub use crate::core::{NoPrefixCache, PrefixPort, Scheduler, SchedulerConfig};

/// The prefix-cache actor as a [`PrefixPort`]: one blocking exchange per step.
struct ActorPort(mpsc::UnboundedSender<PrefixCommand>);

impl PrefixPort for ActorPort {
    fn step(
        &mut self,
        matches: Vec<MatchRequest>,
        inserts: Vec<InsertRequest>,
        reclaim_pages: usize,
    ) -> Vec<PrefixMatch> {
        let misses: Vec<PrefixMatch> = NoPrefixCache.step(matches.clone(), Vec::new(), 0);
        let (reply, rx) = oneshot::channel();
        if self.0.send(PrefixCommand::Step { matches, inserts, reclaim_pages, reply }).is_err() {
            tracing::error!("prefix cache is gone; continuing without it");
            return misses;
        }
        rx.blocking_recv().unwrap_or(misses)
    }
}

/// Cloneable handle to the scheduler actor.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    tx: mpsc::UnboundedSender<SchedulerCommand>,
}

impl SchedulerHandle {
    /// Sends a command; `false` when the actor is gone.
    pub fn send(&self, cmd: SchedulerCommand) -> bool {
        self.tx.send(cmd).is_ok()
    }

    /// The actor's inbox, for actors that talk to it through `osprey-protocol` messages only.
    pub fn sender(&self) -> mpsc::UnboundedSender<SchedulerCommand> {
        self.tx.clone()
    }
}

/// Shortest time between two [`release_free_memory`] calls.
const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Returns the allocator's free pages to the system (glibc's `malloc_trim`). A burst of large requests
/// (64 MB bodies, decoded images) leaves freed memory in the allocator's per-thread arenas, which glibc
/// keeps: without this an idle server stayed ~15 MB above where it was after a soak of abusive bodies.
/// Called when the engine goes idle, at most every [`TRIM_INTERVAL`]; it costs about a millisecond.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own heaps.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Starts the scheduler thread, driving `runner`.
pub fn spawn(
    cfg: SchedulerConfig,
    runner: mpsc::UnboundedSender<RunnerCommand>,
    prefix: Option<mpsc::UnboundedSender<PrefixCommand>>,
) -> SchedulerHandle {
    let (tx, mut rx) = mpsc::unbounded_channel::<SchedulerCommand>();
    thread::Builder::new()
        .name("osprey-scheduler".into())
        .spawn(move || {
            let mut s = Scheduler::new(cfg);
            let mut port: Box<dyn PrefixPort> = match prefix {
                Some(tx) => Box::new(ActorPort(tx)),
                None => Box::new(NoPrefixCache),
            };
            let mut trimmed = std::time::Instant::now();
            let mut worked = false;
            loop {
                // Going idle after work: give the heap's free pages back (rate-limited).
                if worked && !s.has_work() && trimmed.elapsed() >= TRIM_INTERVAL {
                    release_free_memory();
                    trimmed = std::time::Instant::now();
                    worked = false;
                }
                // Block only when idle; otherwise take what is queued and step.
                let first = if s.has_work() {
                    match rx.try_recv() {
                        Ok(c) => Some(c),
                        Err(mpsc::error::TryRecvError::Empty) => None,
                        Err(mpsc::error::TryRecvError::Disconnected) => return,
                    }
                } else {
                    match rx.blocking_recv() {
                        Some(c) => Some(c),
                        None => return,
                    }
                };
                let mut next = first;
                while let Some(cmd) = next {
                    match cmd {
                        SchedulerCommand::Submit { request, events, accepted } => {
                            let _ = accepted.send(s.submit(*request, events));
                        }
                        SchedulerCommand::Cancel { id } => s.cancel(id),
                        SchedulerCommand::Stats { reply } => {
                            let _ = reply.send(s.stats());
                        }
                    }
                    next = rx.try_recv().ok();
                }
                let Some(plan) = s.schedule(port.as_mut()) else { continue };
                worked = true;
                let (reply, wait) = oneshot::channel();
                if runner.send(RunnerCommand::Step { plan: plan.clone(), reply }).is_err() {
                    tracing::error!("runner is gone; scheduler stops");
                    // Closed before the requests fail (dropping `s` ends their streams), so that `/health`
                    // already reads the engine as stopped when a client sees its request fail.
                    rx.close();
                    return;
                }
                match wait.blocking_recv() {
                    Ok(result) => {
                        s.update(&plan, result);
                        if plan.items.is_empty() && plan.release.is_empty() && plan.preempt.is_empty() {
                            // Waiting for pages: ask again shortly rather than spin.
                            thread::sleep(std::time::Duration::from_millis(2));
                        }
                    }
                    Err(_) => {
                        tracing::error!("runner dropped a step; scheduler stops");
                        rx.close();
                        return;
                    }
                }
            }
        })
        .expect("spawn scheduler thread");
    SchedulerHandle { tx }
}
