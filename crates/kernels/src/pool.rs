//! A persistent pool for the kernels' data-parallel loops, in the manner of ggml's: the calling thread
//! takes part, the workers spin for a short while between operations instead of sleeping, and an
//! operation's items are claimed from one shared counter, so a decode step's hundreds of small matmuls
//! pay no per-operation wake-up.
//!
//! Why not rayon: the runner is not a rayon worker, so every `par_iter` injected a job into the global
//! queue, woke a sleeping worker through the kernel and put the caller to sleep until it finished —
//! about 13% of a decode step went to that (perf: `__schedule`, `futex`, `sched_yield`). Rayon stays the
//! fallback when the pool is already busy (a second actor calling kernels at the same time), so nothing
//! waits on anything but its own work. A kernel called from inside an item (the pool's or rayon's) runs
//! its items on that thread: every thread is already busy with the outer job, so splitting again would
//! only queue work behind it (the routed experts of a decode step run one per item, each inline).
//!
//! Protocol: one job at a time (a try-lock). The job's function and item count are written, then a
//! 64-bit word packing (generation, next item) is reset to the new generation; an item is claimed by a
//! compare-and-swap that checks the generation, so a worker that wakes late can never claim an item of a
//! job that has moved on. Workers count themselves in `active` before they look at a job and the caller
//! returns only when every item is claimed and `active` is zero, so the borrowed function outlives every
//! call to it.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps: long enough to bridge the serial work between two
/// operations of a decode step (norms, residuals, sampling: tens of microseconds), short enough that an
/// idle server does not burn a core.
const SPIN: Duration = Duration::from_micros(300);

/// The claimer a job function receives: call [`Claims::next`] until it returns `None`.
#[derive(Debug)]
pub struct Claims<'a> {
    counter: &'a AtomicU64,
    items: u64,
    generation: u64,
}

impl Claims<'_> {
    /// The next unclaimed item of this job, if any.
    pub fn next(&self) -> Option<usize> {
        let mut cur = self.counter.load(SeqCst);
        loop {
            if cur >> 32 != self.generation || (cur & 0xffff_ffff) >= self.items {
                return None;
            }
            match self.counter.compare_exchange_weak(cur, cur + 1, SeqCst, SeqCst) {
                Ok(_) => return Some((cur & 0xffff_ffff) as usize),
                Err(now) => cur = now,
            }
        }
    }
}

type JobFn<'a> = dyn Fn(&Claims<'_>) + Sync + 'a;

struct Pool {
    /// Held by the one caller whose job is posted.
    dispatch: Mutex<()>,
    /// The posted job's function, with its lifetime erased: valid while its caller is inside `run`.
    job: UnsafeCell<Option<*const JobFn<'static>>>,
    items: AtomicUsize,
    /// (generation << 32) | next item.
    counter: AtomicU64,
    /// Workers inside the current job (or checking whether to join it).
    active: AtomicUsize,
    /// Sleeping workers and what wakes them.
    sleepers: Mutex<usize>,
    wake: Condvar,
    workers: usize,
    /// An item panicked on a worker during the current job (the caller re-raises it).
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the dispatch-lock holder while no worker can join (every item of
// the previous job claimed and `active` zero) and read by workers only after joining the current
// generation; everything else is atomic or locked.
unsafe impl Sync for Pool {}
unsafe impl Send for Pool {}

static POOL: OnceLock<&'static Pool> = OnceLock::new();

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let workers = rayon::current_num_threads().saturating_sub(1);
        let p: &'static Pool = Box::leak(Box::new(Pool {
            dispatch: Mutex::new(()),
            job: UnsafeCell::new(None),
            items: AtomicUsize::new(0),
            counter: AtomicU64::new(0),
            active: AtomicUsize::new(0),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
            workers,
            panicked: AtomicBool::new(false),
        }));
        for i in 0..workers {
            let spawned = std::thread::Builder::new().name(format!("osprey-kernel-{i}")).spawn(move || p.work());
            if spawned.is_err() {
                // Fewer workers only means less parallelism: the caller claims every item it is left.
                break;
            }
        }
        p
    })
}

/// Threads an operation is split across: the caller and the pool's workers (rayon's thread count,
/// which `--threads` sets at startup).
pub fn threads() -> usize {
    pool().workers + 1
}

/// Runs `body(state, i)` for every `i < n` across the pool; each participating thread makes its own
/// `state` with `init` (scratch buffers) once per call. Returns when every item is done.
pub fn for_each_init<S>(n: usize, init: impl Fn() -> S + Sync, body: impl Fn(&mut S, usize) + Sync) {
    run(n, &|claims: &Claims<'_>| {
        if let Some(i) = claims.next() {
            let mut s = init();
            body(&mut s, i);
            while let Some(i) = claims.next() {
                body(&mut s, i);
            }
        }
    });
}

/// [`for_each_init`] without state.
pub fn for_each(n: usize, body: impl Fn(usize) + Sync) {
    for_each_init(n, || (), |_, i| body(i));
}

/// `body(c, chunk)` for every `size`-element chunk of `data` (the last may be shorter), across the pool.
pub fn chunks_mut<T: Send>(data: &mut [T], size: usize, body: impl Fn(usize, &mut [T]) + Sync) {
    chunks_mut_init(data, size, || (), |_, c, chunk| body(c, chunk));
}

/// [`chunks_mut`] with per-thread state made by `init`.
pub fn chunks_mut_init<T: Send, S>(
    data: &mut [T],
    size: usize,
    init: impl Fn() -> S + Sync,
    body: impl Fn(&mut S, usize, &mut [T]) + Sync,
) {
    let size = size.max(1);
    let (len, base) = (data.len(), SendPtr(data.as_mut_ptr()));
    for_each_init(len.div_ceil(size), init, |s, c| {
        let start = c * size;
        let base = &base;
        // SAFETY: item `c` is run once, and chunk `c` is [c·size, min((c+1)·size, len)): disjoint from
        // every other item's and inside `data`, which the caller lends mutably until all items are done.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), size.min(len - start)) };
        body(s, c, chunk)
    });
}

/// The output of a kernel whose pool items write disjoint elements of it (their own column blocks).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every item writes a disjoint set of output elements.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// A pointer into a slice that items write disjoint parts of.
struct SendPtr<T>(*mut T);
// SAFETY: used only by `chunks_mut_init`, whose items touch disjoint elements.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// `f(i)` for every `i < n` across the pool, collected in order.
pub fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    chunks_mut(&mut out, 1, |i, slot| slot[0] = Some(f(i)));
    out.into_iter().map(|r| r.expect("the pool runs every item")).collect()
}

thread_local! {
    /// Whether this thread is running an item of a job (the pool's or the fallback's).
    static IN_ITEM: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks this thread as inside an item until dropped (also on unwinding).
struct InItem(bool);

impl InItem {
    fn enter() -> Self {
        InItem(IN_ITEM.with(|c| c.replace(true)))
    }
}

impl Drop for InItem {
    fn drop(&mut self) {
        IN_ITEM.with(|c| c.set(self.0));
    }
}

/// Runs every item of `f` on this thread.
fn inline(n: usize, f: &JobFn<'_>) {
    let counter = AtomicU64::new(1 << 32);
    f(&Claims { counter: &counter, items: n as u64, generation: 1 })
}

fn run(n: usize, f: &JobFn<'_>) {
    if n == 0 {
        return;
    }
    if IN_ITEM.with(|c| c.get()) {
        // A kernel inside an item (the experts of a decode step, one per item): every thread is
        // already busy with the outer job, so its items run here, in order.
        return inline(n, f);
    }
    let p = pool();
    let guard = match p.dispatch.try_lock() {
        // Poisoned: a caller unwound through `Finish`, which left the pool consistent.
        Ok(g) if n > 1 && p.workers > 0 => g,
        Err(TryLockError::Poisoned(g)) if n > 1 && p.workers > 0 => g.into_inner(),
        Ok(_) | Err(_) => {
            // Busy (another caller), one item, or no workers: rayon or inline, never a wait on
            // someone else's job.
            return fallback(n, f);
        }
    };
    // SAFETY (job): no worker reads `job` now — the previous job's items are all claimed and its
    // participants gone (the previous `run` returned, or unwound through `Finish`, only then), and the
    // generation is not yet bumped.
    unsafe { *p.job.get() = Some(std::mem::transmute::<&JobFn<'_>, &'static JobFn<'static>>(f) as *const _) };
    p.items.store(n, SeqCst);
    p.panicked.store(false, SeqCst);
    let generation = (p.counter.load(SeqCst) >> 32) + 1;
    p.counter.store(generation << 32, SeqCst);
    if *p.sleepers.lock().unwrap_or_else(|e| e.into_inner()) > 0 {
        p.wake.notify_all();
    }
    let finish = Finish { pool: p, generation };
    {
        let _item = InItem::enter();
        f(&Claims { counter: &p.counter, items: n as u64, generation });
    }
    drop(finish);
    drop(guard);
    if p.panicked.load(SeqCst) {
        panic!("a kernel item panicked on a pool worker");
    }
}

/// Ends the posted job, also when the caller unwinds: no item is claimed after it, and it returns only
/// when no worker is inside the job, so the caller's function is never called after `run` leaves.
struct Finish<'a> {
    pool: &'a Pool,
    generation: u64,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let p = self.pool;
        p.counter.store((self.generation << 32) | 0xffff_ffff, SeqCst);
        while p.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        // SAFETY: no worker is in the job and none can join it (no item left).
        unsafe { *p.job.get() = None };
    }
}

/// A job the pool cannot take: split it over rayon (each rayon thread a participant).
fn fallback(n: usize, f: &JobFn<'_>) {
    if n == 1 || rayon::current_num_threads() == 1 {
        let _item = InItem::enter();
        return inline(n, f);
    }
    let counter = AtomicU64::new(1 << 32);
    let claims = || Claims { counter: &counter, items: n as u64, generation: 1 };
    let item = |c: Claims<'_>| {
        let _item = InItem::enter();
        f(&c)
    };
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads().min(n) {
            s.spawn(|_| item(claims()));
        }
        item(claims());
    });
}

impl Pool {
    fn work(&self) {
        let mut seen = 0u64;
        loop {
            let generation = self.wait_for_job(seen);
            seen = generation;
            self.active.fetch_add(1, SeqCst);
            let cur = self.counter.load(SeqCst);
            if cur >> 32 == generation && (cur & 0xffff_ffff) < self.items.load(SeqCst) as u64 {
                // SAFETY: we are counted in `active` and the job of `generation` still has items, so
                // its caller is inside `run` and `job` holds its function.
                if let Some(f) = unsafe { *self.job.get() } {
                    let claims = Claims { counter: &self.counter, items: self.items.load(SeqCst) as u64, generation };
                    // SAFETY: as above. A panic is caught so `active` still drops; the caller re-raises it.
                    let call = std::panic::AssertUnwindSafe(|| {
                        let _item = InItem::enter();
                        unsafe { (*f)(&claims) }
                    });
                    if std::panic::catch_unwind(call).is_err() {
                        self.panicked.store(true, SeqCst);
                    }
                }
            }
            self.active.fetch_sub(1, SeqCst);
        }
    }

    /// Spins, then sleeps, until a generation newer than `seen` is posted; returns it.
    fn wait_for_job(&self, seen: u64) -> u64 {
        let newer = || {
            let g = self.counter.load(SeqCst) >> 32;
            (g != seen).then_some(g)
        };
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if let Some(g) = newer() {
                return g;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                break;
            }
        }
        let mut sleeping = self.sleepers.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // Checked under the lock the poster takes to notify: no wake-up is lost.
            if let Some(g) = newer() {
                return g;
            }
            *sleeping += 1;
            sleeping = self.wake.wait(sleeping).unwrap_or_else(|e| e.into_inner());
            *sleeping -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_item_runs_exactly_once_across_many_jobs_and_concurrent_callers() {
        let callers: Vec<_> = (0..3)
            .map(|c| {
                std::thread::spawn(move || {
                    for job in 0..300usize {
                        let n = 1 + (job * 7 + c) % 97;
                        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                        for_each_init(
                            n,
                            || 0usize,
                            |count, i| {
                                *count += 1;
                                hits[i].fetch_add(1, SeqCst);
                            },
                        );
                        assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "caller {c} job {job}");
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().expect("caller");
        }
    }

    /// A kernel called from inside an item runs all its items on that item's thread, each once, and a
    /// call after the outer job is split again. Mutation-checked: without the inline branch the nested
    /// jobs go to rayon and the thread check fails.
    #[test]
    fn a_job_inside_an_item_runs_on_that_thread() {
        let outer = 6;
        let nested: Vec<Vec<AtomicU32>> = (0..outer).map(|_| (0..9).map(|_| AtomicU32::new(0)).collect()).collect();
        let elsewhere = AtomicU32::new(0);
        for_each(outer, |o| {
            let me = std::thread::current().id();
            for_each(9, |i| {
                nested[o][i].fetch_add(1, SeqCst);
                if std::thread::current().id() != me {
                    elsewhere.fetch_add(1, SeqCst);
                }
            });
        });
        assert!(nested.iter().flatten().all(|h| h.load(SeqCst) == 1), "a nested item ran twice or never");
        assert_eq!(elsewhere.load(SeqCst), 0, "a nested item left its outer item's thread");
        assert!(!IN_ITEM.with(|c| c.get()), "the caller is still marked inside an item");
    }

    #[test]
    fn chunks_cover_the_slice_once_with_a_short_last_chunk() {
        let mut v = vec![0u32; 1000];
        chunks_mut(&mut v, 64, |c, chunk| {
            for (j, x) in chunk.iter_mut().enumerate() {
                *x += (c * 64 + j) as u32;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
    }

    #[test]
    fn a_job_started_from_inside_an_item_completes() {
        let total = AtomicU32::new(0);
        for_each(8, |_| {
            for_each(5, |_| {
                total.fetch_add(1, SeqCst);
            })
        });
        assert_eq!(total.load(SeqCst), 40);
    }

    #[test]
    fn a_panicking_item_reaches_the_caller_and_the_pool_keeps_working() {
        for _ in 0..20 {
            let r = std::panic::catch_unwind(|| for_each(64, |i| assert!(i != 40, "item 40")));
            assert!(r.is_err());
            let hits = AtomicU32::new(0);
            for_each(64, |_| {
                hits.fetch_add(1, SeqCst);
            });
            assert_eq!(hits.load(SeqCst), 64);
        }
    }

    #[test]
    fn workers_that_slept_wake_for_the_next_job() {
        for_each(4, |_| ());
        std::thread::sleep(SPIN * 4);
        let hits = AtomicU32::new(0);
        for_each(64, |_| {
            hits.fetch_add(1, SeqCst);
        });
        assert_eq!(hits.load(SeqCst), 64);
    }
}
