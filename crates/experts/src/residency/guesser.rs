//! The read-ahead thread: guessed experts read while the manager serves requests.

use std::sync::Arc;

use osprey_models::{ExpertKey, ExpertWeights};

use super::read::{read_experts, HostTier};
use crate::arena::Arena;
use crate::reader::Reader;
use crate::store::ExpertIndex;

/// A guessed expert read by the read-ahead thread.
pub(super) struct Landed {
    pub(super) key: ExpertKey,
    /// The layer's step count when the guess was asked for (a guess landing after its layer's step is
    /// wasted at once).
    pub(super) step: u64,
    pub(super) read: Result<(ExpertWeights, usize), String>,
    pub(super) secs: f64,
}

/// The read-ahead thread's two ends, as the manager holds them.
pub(super) struct Guesser {
    pub(super) jobs: std::sync::mpsc::Sender<(ExpertKey, u64)>,
    pub(super) landed: std::sync::mpsc::Receiver<Landed>,
    /// Guesses asked for and not landed: their bytes.
    pub(super) inflight: std::collections::HashMap<ExpertKey, usize>,
}

/// Starts the read-ahead thread: it reads the guesses the manager hands it with a reader of its own,
/// every guess queued so far in one batch (one io_uring submission), into free slots of the manager's
/// arena (`arena`; buffers of their own past it), and sends each back. The manager never waits for it
/// except where a request needs an expert it is reading.
pub(super) fn start_guesser(index: ExpertIndex, mut reader: Box<dyn Reader>, arena: Option<Arc<Arena>>) -> Guesser {
    let (jobs, job_rx) = std::sync::mpsc::channel::<(ExpertKey, u64)>();
    let (landed_tx, landed) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().name("osprey-guesses".into()).spawn(move || {
        while let Ok(first) = job_rx.recv() {
            let mut batch = vec![first];
            batch.extend(job_rx.try_iter());
            let items: Vec<ExpertKey> = batch.iter().map(|&(k, _)| k).collect();
            // Its own ring did not register the arena: plain reads into the slots.
            let tier = arena.as_ref().map(|a| HostTier { arena: a.clone(), registered: false });
            let (read, secs) = read_experts(&index, reader.as_mut(), tier.as_ref(), &items);
            let each = secs / batch.len() as f64;
            for ((key, step), read) in batch.into_iter().zip(read) {
                if landed_tx.send(Landed { key, step, read, secs: each }).is_err() {
                    return;
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no read-ahead thread; guesses are ignored");
    }
    Guesser { jobs, landed, inflight: std::collections::HashMap::new() }
}
