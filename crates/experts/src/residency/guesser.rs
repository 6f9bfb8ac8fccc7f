//! The read-ahead thread: guessed experts read while the manager serves requests, at a lower priority
//! than the reads a layer waits for (issue 55).
//!
//! Guesses wait in a queue the manager fills, most wanted first. The thread takes one expert at a time
//! and reads it in pieces, submitting each only while no demand read is under way ([`Guesser::demand`]):
//! a layer's misses queue behind at most the window of pieces already at the disk ([`window_for`]; a
//! read at the device cannot be recalled, so what bounds the delay is that nothing more is submitted).
//! When a layer's step comes, its guesses still queued are dropped before submission (cancelled: the
//! step reads what it needs itself), and the one being read is given up if the step does not need it,
//! so a wrong guess costs disk time only while the disk would otherwise idle.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use osprey_models::{ExpertKey, ExpertWeights};

use super::read::{read_experts_with, HostTier};
use crate::arena::Arena;
use crate::reader::{window, Dest, ReadReq, Reader};
use crate::store::ExpertIndex;

/// A guessed expert is read in pieces of half its window ([`window_for`]), so two are at the disk at once:
/// the next goes out as one completes (unless a demand read is under way), and the disk has the other
/// while the thread wakes up to submit it. The smallest piece.
const PIECE: usize = 256 << 10;
/// Bytes of wrong guesses a demand read may expect to queue behind: about 0.4 ms at 1.3 GB/s, where a
/// whole expert of Qwen3.5-35B-A3B is 1.8 MB.
const WRONG_BYTES: usize = 2 * PIECE;
/// The most bytes of one guess at the disk at once.
const MOST_BYTES: usize = 8 * WRONG_BYTES;

/// Bytes of a guess of measured precision `sure` kept at the disk at once: `WRONG_BYTES / (1 − sure)`,
/// so the bytes of wrong guesses a demand read queues behind stay `WRONG_BYTES` in expectation, between
/// `WRONG_BYTES` (at least two pieces, so the disk has the next while the thread wakes to submit
/// another) and `MOST_BYTES` (a sure guess keeps the disk streaming as a demand read does: a window of
/// two pieces left it idle between them on a 2-core machine busy computing, docs/benchmarks.md).
fn window_for(sure: f32) -> usize {
    let sure = if sure.is_finite() { sure.clamp(0.0, 1.0) } else { 0.0 };
    let wrong = (1.0 - sure).max(WRONG_BYTES as f32 / MOST_BYTES as f32);
    ((WRONG_BYTES as f32 / wrong) as usize).clamp(WRONG_BYTES, MOST_BYTES)
}

/// A guessed expert read by the read-ahead thread.
pub(super) struct Landed {
    pub(super) key: ExpertKey,
    /// The layer's step count when the guess was asked for (a guess landing after its layer's step is
    /// wasted at once).
    pub(super) step: u64,
    pub(super) read: Result<(ExpertWeights, usize), String>,
    pub(super) secs: f64,
    /// Seconds demand reads waited behind this one's pieces (being read when a step's misses came).
    pub(super) delayed: f64,
    /// Given up part way: its layer's step came and did not need it.
    pub(super) abandoned: bool,
}

/// A guess queued for the thread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Job {
    pub(super) key: ExpertKey,
    /// Its layer's step count when asked for.
    pub(super) step: u64,
    /// Its measured precision (1: unmeasured).
    pub(super) sure: f32,
}

/// What the manager and the thread share.
#[derive(Default)]
struct State {
    /// Guesses not yet submitted, most wanted first.
    queue: VecDeque<Job>,
    /// Demand reads under way (the thread submits nothing while there is one).
    demand: usize,
    /// When the first of them started, while the thread was reading a guess (that read delays it).
    blocked_since: Option<Instant>,
    /// The thread has pieces of a guess at the disk now.
    reading: bool,
    /// The guess the thread is reading (between its pieces, too).
    current: Option<ExpertKey>,
    /// The thread is to give `current` up at its next piece.
    abandon: bool,
    /// The thread holds pieces back until a demand read is done.
    held_back: bool,
    /// The manager is gone.
    closed: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The read-ahead thread's ends, as the manager holds them.
pub(super) struct Guesser {
    shared: Arc<Shared>,
    pub(super) landed: std::sync::mpsc::Receiver<Landed>,
    /// Guesses asked for and not landed nor cancelled (queued or being read): their bytes.
    pub(super) inflight: HashMap<ExpertKey, usize>,
}

impl Guesser {
    /// Queues guesses at the back, in order.
    pub(super) fn push(&mut self, jobs: impl IntoIterator<Item = (Job, usize)>) {
        let mut s = self.shared.lock();
        for (job, bytes) in jobs {
            s.queue.push_back(job);
            self.inflight.insert(job.key, bytes);
        }
        drop(s);
        self.shared.wake.notify_all();
    }

    /// Drops the queued guesses of `layer` before they are submitted (its step has come): the keys.
    pub(super) fn cancel_layer(&mut self, layer: usize) -> Vec<ExpertKey> {
        let mut s = self.shared.lock();
        let mut gone = Vec::new();
        s.queue.retain(|j| {
            let keep = j.key.layer() != layer;
            if !keep {
                gone.push(j.key);
            }
            keep
        });
        drop(s);
        gone.iter().for_each(|k| {
            self.inflight.remove(k);
        });
        gone
    }

    /// A step of `layer` that needs `need` has come: the guess being read is given up at its next piece
    /// if it is of that layer and not needed (a read of a needed one goes on: it is the quickest way).
    pub(super) fn abandon_unless(&self, layer: usize, need: &[ExpertKey]) {
        let mut s = self.shared.lock();
        if s.current.is_some_and(|k| k.layer() == layer && !need.contains(&k)) {
            s.abandon = true;
        }
    }

    /// A demand read starts: the thread submits nothing more until [`Guesser::demand_done`].
    pub(super) fn demand(&self) {
        let mut s = self.shared.lock();
        s.demand += 1;
        if s.reading && s.blocked_since.is_none() {
            s.blocked_since = Some(Instant::now());
        }
    }

    /// A demand read is done.
    pub(super) fn demand_done(&self) {
        let mut s = self.shared.lock();
        s.demand = s.demand.saturating_sub(1);
        drop(s);
        self.shared.wake.notify_all();
    }
}

impl Drop for Guesser {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_all();
    }
}

/// Starts the read-ahead thread: it reads the guesses the manager queues, one expert at a time while no
/// demand read is under way, with a reader of its own, into free slots of the manager's arena (`arena`;
/// buffers of their own past it), and sends each back. The manager never waits for it except where a
/// request needs the expert it is reading.
pub(super) fn start_guesser(index: ExpertIndex, mut reader: Box<dyn Reader>, arena: Option<Arc<Arena>>) -> Guesser {
    let shared = Arc::new(Shared::default());
    let (landed_tx, landed) = std::sync::mpsc::channel();
    let ours = shared.clone();
    let spawned = std::thread::Builder::new().name("osprey-guesses".into()).spawn(move || {
        super::io_priority();
        // Its own ring did not register the arena: plain reads into the slots.
        let tier = arena.as_ref().map(|a| HostTier { arena: a.clone(), registered: false });
        while let Some(Job { key, step, sure }) = next_job(&ours) {
            let (mut delayed, mut abandoned, mut secs) = (0.0, false, 0.0);
            // The seconds its pieces were at the disk (not those paused for demand reads).
            let (mut read, _) = read_experts_with(&index, tier.as_ref(), &[key], |reqs, dests| {
                let stats = (&mut delayed, &mut abandoned, &mut secs);
                read_in_pieces(reader.as_mut(), &ours, (reqs, dests, window_for(sure)), stats)
            });
            {
                let mut s = ours.lock();
                (s.current, s.abandon) = (None, false);
            }
            let read = read.pop().unwrap_or_else(|| Err("no read result".into()));
            if landed_tx.send(Landed { key, step, read, secs, delayed, abandoned }).is_err() {
                return;
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no read-ahead thread; guesses are ignored");
    }
    Guesser { shared, landed, inflight: HashMap::new() }
}

/// The next guess to read, once one is queued and no demand read is under way; `None` once closed.
fn next_job(shared: &Shared) -> Option<Job> {
    let mut s = shared.lock();
    loop {
        if s.closed {
            return None;
        }
        if s.demand == 0 {
            if let Some(job) = s.queue.pop_front() {
                s.current = Some(job.key);
                return Some(job);
            }
        }
        s = shared.wake.wait(s).unwrap_or_else(PoisonError::into_inner);
    }
}

/// Reads each request's aligned window into its destination as [`Reader::read_into`] does, in pieces of
/// half of `most` (at least [`PIECE`]), at most `most` bytes of them at the disk, submitting each only
/// while no demand read is under way. Adds to `delayed` the seconds demand reads shared the disk with
/// its pieces (from a demand's start to the next piece that completes after it); gives up (`abandoned`:
/// every request not read fails) if the manager has it give the guess up, or closes. `secs`: the
/// seconds it read.
fn read_in_pieces(
    reader: &mut dyn Reader,
    shared: &Shared,
    (reqs, dests, most): (&[ReadReq], &[Dest], usize),
    (delayed, abandoned, secs): (&mut f64, &mut bool, &mut f64),
) -> Vec<std::io::Result<usize>> {
    let mut out: Vec<std::io::Result<usize>> = Vec::with_capacity(reqs.len());
    let piece = (most / 2).max(PIECE) / crate::buf::ALIGN * crate::buf::ALIGN;
    let (mut pieces, mut places, mut owner) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (r, d)) in reqs.iter().zip(dests).enumerate() {
        let (start, at, total) = window(r.offset, r.len);
        if total > d.cap {
            out.push(Err(std::io::Error::other("read destination smaller than its window")));
            continue;
        }
        out.push(Ok(at));
        let wanted = at + r.len;
        for o in (0..total).step_by(piece) {
            // Each piece starts aligned and asks for the wanted bytes in it (a file's last window may run
            // past its end, as a whole window read does).
            pieces.push(ReadReq { file: r.file, offset: start + o as u64, len: piece.min(wanted - o) });
            // SAFETY: `o < total <= d.cap`: inside the destination.
            places.push(Dest { ptr: unsafe { d.ptr.add(o) }, cap: piece.min(total - o), fixed: d.fixed });
            owner.push(i);
        }
    }
    let mut waited = 0.0;
    let mut go = || {
        let mut s = shared.lock();
        // A demand read came while pieces were at the disk: it shared the disk with them until now.
        *delayed += s.blocked_since.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
        loop {
            if s.closed || s.abandon {
                *abandoned = true;
                s.reading = false;
                return false;
            }
            if s.demand == 0 {
                (s.reading, s.held_back) = (true, false);
                return true;
            }
            (s.reading, s.held_back) = (false, true);
            let t = Instant::now();
            s = shared.wake.wait(s).unwrap_or_else(PoisonError::into_inner);
            waited += t.elapsed().as_secs_f64();
        }
    };
    let t0 = Instant::now();
    // SAFETY: each piece lies inside its request's destination, which the caller hands over as
    // `read_into` requires; pieces do not overlap.
    let got = unsafe { reader.read_into_paced(&pieces, &places, most, &mut go) };
    *secs += t0.elapsed().as_secs_f64() - waited;
    {
        let mut s = shared.lock();
        s.reading = false;
        *delayed += s.blocked_since.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
    }
    for (&i, r) in owner.iter().zip(got) {
        if let (Err(e), true) = (r, out[i].is_ok()) {
            out[i] =
                Err(if *abandoned { std::io::Error::other("guess given up: its layer came without it") } else { e });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::reader::{PreadReader, ReadDone, ReaderKind};

    /// Per call: the pieces' (offset, bytes) and the demand reads under way when they were submitted.
    type Calls = Arc<Mutex<Vec<(Vec<(u64, usize)>, usize)>>>;

    /// Reads through a `pread` reader and records its calls; `on_call(n)` runs after the n-th call.
    struct Recording<F: FnMut(usize)> {
        inner: PreadReader,
        shared: Arc<Shared>,
        calls: Calls,
        on_call: F,
    }

    impl<F: FnMut(usize) + Send> Reader for Recording<F> {
        fn read_batch(&mut self, reqs: &[ReadReq]) -> Vec<std::io::Result<ReadDone>> {
            self.inner.read_batch(reqs)
        }
        fn kind(&self) -> ReaderKind {
            ReaderKind::Pread
        }
        unsafe fn read_into(&mut self, reqs: &[ReadReq], dests: &[Dest]) -> Vec<std::io::Result<usize>> {
            let demand = self.shared.lock().demand;
            let n = {
                let mut c = self.calls.lock().expect("calls");
                c.push((reqs.iter().map(|r| (r.offset, r.len)).collect(), demand));
                c.len()
            };
            // SAFETY: the caller's contract, passed on.
            let got = unsafe { self.inner.read_into(reqs, dests) };
            (self.on_call)(n);
            got
        }
    }

    /// A file removed when dropped.
    struct TempFile(std::path::PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A file of `len` bytes, byte i = i·7 mod 251 (no period that aligns with a piece), named `name`.
    fn data_file(name: &str, len: usize) -> (TempFile, std::path::PathBuf, Vec<u8>) {
        let path = std::env::temp_dir().join(format!("osprey-guesser-{name}-{}", std::process::id()));
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::File::create(&path).and_then(|mut f| f.write_all(&data)).expect("write");
        (TempFile(path.clone()), path, data)
    }

    /// Reads `reqs` into buffers of their own windows through `read_in_pieces`: per request its bytes.
    fn read_pieces(reader: &mut dyn Reader, shared: &Shared, reqs: &[ReadReq]) -> (Vec<Vec<u8>>, bool) {
        let mut bufs: Vec<crate::buf::AlignedBuf> =
            reqs.iter().map(|r| crate::buf::AlignedBuf::new(window(r.offset, r.len).2)).collect();
        let dests: Vec<Dest> =
            bufs.iter_mut().map(|b| Dest { ptr: b.as_mut_ptr(), cap: b.len(), fixed: None }).collect();
        let (mut delayed, mut abandoned, mut secs) = (0.0, false, 0.0);
        let got =
            read_in_pieces(reader, shared, (reqs, &dests, WRONG_BYTES), (&mut delayed, &mut abandoned, &mut secs));
        let out = got
            .into_iter()
            .zip(&bufs)
            .zip(reqs)
            .map(|((at, b), r)| at.map(|at| b.as_ref()[at..at + r.len].to_vec()).unwrap_or_default())
            .collect();
        (out, abandoned)
    }

    /// A guessed expert read in pieces gets exactly the bytes a whole read gets: an unaligned start, a
    /// range of several pieces, and one whose window runs past the end of the file; every piece starts
    /// aligned and is at most `PIECE` bytes, and a submission holds at most the window's bytes.
    #[test]
    fn pieces_read_what_a_whole_read_reads() {
        let len = 3 * PIECE + 12_345;
        let (_file, path, data) = data_file("whole", len);
        let shared = Arc::new(Shared::default());
        let calls = Arc::new(Mutex::new(Vec::new()));
        let inner = PreadReader::new(&[path], 2).expect("reader");
        let mut r = Recording { inner, shared: shared.clone(), calls: calls.clone(), on_call: |_| {} };
        let reqs = [
            ReadReq { file: 0, offset: 5_000, len: 2 * PIECE + 777 },
            ReadReq { file: 0, offset: (len - 9_000) as u64, len: 9_000 },
        ];
        let (got, abandoned) = read_pieces(&mut r, &shared, &reqs);
        assert!(!abandoned);
        for (g, q) in got.iter().zip(&reqs) {
            assert!(g[..] == data[q.offset as usize..q.offset as usize + q.len], "bytes of {q:?}");
        }
        let calls = calls.lock().expect("calls");
        assert!(calls.len() >= 2, "in several submissions: {}", calls.len());
        for (pieces, _) in calls.iter() {
            assert!(
                pieces.iter().map(|p| p.1.div_ceil(crate::buf::ALIGN) * crate::buf::ALIGN).sum::<usize>()
                    <= WRONG_BYTES
            );
            assert!(pieces.iter().all(|&(o, n)| o % crate::buf::ALIGN as u64 == 0 && n <= PIECE), "{pieces:?}");
        }
    }

    /// Issue 55: a demand read that starts while a guess is being read holds the guess's next pieces
    /// back until it is done: no piece is submitted while a demand read is under way (the demand starts
    /// right after the first submission; it ends only once the read-ahead side is seen holding back).
    #[test]
    fn no_guess_piece_is_submitted_while_a_demand_read_is_under_way() {
        let (_file, path, data) = data_file("demand", 4 * PIECE);
        let shared = Arc::new(Shared::default());
        let calls = Arc::new(Mutex::new(Vec::new()));
        let (started_tx, started) = std::sync::mpsc::channel();
        let demand_side = {
            let (shared, calls) = (shared.clone(), calls.clone());
            std::thread::spawn(move || {
                let _: usize = started.recv().expect("first piece");
                // Ends the demand once the read-ahead side holds back (or, if it never does, once it
                // has gone on regardless, which the assertion below catches).
                loop {
                    let s = shared.lock();
                    if s.held_back || calls.lock().expect("calls").len() > 1 {
                        break;
                    }
                    drop(s);
                    std::thread::yield_now();
                }
                let mut s = shared.lock();
                s.demand -= 1;
                drop(s);
                shared.wake.notify_all();
            })
        };
        let on_call = {
            let shared = shared.clone();
            move |n: usize| {
                if n == 1 {
                    shared.lock().demand += 1;
                    started_tx.send(n).expect("demand side");
                }
            }
        };
        let inner = PreadReader::new(&[path], 2).expect("reader");
        let mut r = Recording { inner, shared: shared.clone(), calls: calls.clone(), on_call };
        let reqs = [ReadReq { file: 0, offset: 0, len: 4 * PIECE }];
        let (got, _) = read_pieces(&mut r, &shared, &reqs);
        demand_side.join().expect("demand side");
        assert!(got[0] == data, "the guess still reads its bytes");
        let calls = calls.lock().expect("calls");
        assert!(calls.len() > 1);
        assert!(calls.iter().all(|&(_, demand)| demand == 0), "a piece went out during a demand read: {calls:?}");
    }

    /// The window keeps the bytes of wrong guesses a demand read may queue behind at `WRONG_BYTES` in
    /// expectation, within its bounds.
    #[test]
    fn a_surer_guess_keeps_more_at_the_disk() {
        assert_eq!(window_for(0.0), WRONG_BYTES);
        assert_eq!(window_for(0.5), 2 * WRONG_BYTES);
        assert_eq!(window_for(0.75), 4 * WRONG_BYTES);
        assert_eq!(window_for(1.0), MOST_BYTES);
        assert_eq!(window_for(f32::NAN), WRONG_BYTES);
    }

    /// A guess given up part way stops at its next piece and says so.
    #[test]
    fn an_abandoned_guess_stops_at_its_next_piece() {
        let (_file, path, _) = data_file("abandon", 4 * PIECE);
        let shared = Arc::new(Shared::default());
        let calls = Arc::new(Mutex::new(Vec::new()));
        let on_call = {
            let shared = shared.clone();
            move |_| shared.lock().abandon = true
        };
        let inner = PreadReader::new(&[path], 2).expect("reader");
        let mut r = Recording { inner, shared: shared.clone(), calls: calls.clone(), on_call };
        let (_, abandoned) = read_pieces(&mut r, &shared, &[ReadReq { file: 0, offset: 0, len: 4 * PIECE }]);
        assert!(abandoned);
        assert_eq!(calls.lock().expect("calls").len(), 1, "nothing submitted after it was given up");
    }

    /// When a layer's step comes, its queued guesses are dropped (not the other layers'), and no longer
    /// counted as being read; a guess being read of that layer is given up only if the step does not
    /// need it.
    #[test]
    fn a_layers_step_cancels_its_queued_guesses_only() {
        let (_tx, landed) = std::sync::mpsc::channel();
        let mut g = Guesser { shared: Arc::new(Shared::default()), landed, inflight: HashMap::new() };
        let k = |l, e| ExpertKey::new(l, e);
        let job = |key| Job { key, step: 0, sure: 1.0 };
        g.push([(job(k(1, 3)), 10), (job(k(2, 5)), 20), (job(k(1, 4)), 30)]);
        assert_eq!(g.cancel_layer(1), vec![k(1, 3), k(1, 4)]);
        assert_eq!(g.inflight.keys().copied().collect::<Vec<_>>(), vec![k(2, 5)]);
        assert_eq!(g.shared.lock().queue.iter().map(|j| j.key).collect::<Vec<_>>(), vec![k(2, 5)]);
        g.shared.lock().current = Some(k(2, 5));
        g.abandon_unless(2, &[k(2, 5)]);
        assert!(!g.shared.lock().abandon, "a needed guess is read on");
        g.abandon_unless(1, &[]);
        assert!(!g.shared.lock().abandon, "another layer's guess is read on");
        g.abandon_unless(2, &[k(2, 6)]);
        assert!(g.shared.lock().abandon);
    }
}
