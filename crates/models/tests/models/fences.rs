//! The execution contract under a backend whose fences complete late: ops are "queued" (the CPU runs
//! them at once, but a fence counts as complete only once waited for, or when the simulated device
//! catches up at random), and the backend checks that the MoE block never overwrites an expert slot
//! before the slot's last reader — the copy is either issued after that reader's fence completed or
//! ordered after it (`upload_expert`'s `after`, which a device's copy stream waits for without the host) —
//! that no RAM lease handed over with an upload ends before that upload's fence (the wrapper keeps each
//! lease until then, as a device backend must: the CUDA backend's `uploading`), and that no host snapshot
//! is read (uploaded back) before the fence of the copy that filled it. One slot per layer, so every step reuses slots in waves; the answers
//! must still be the CPU backend's bits.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use osprey_backend::{
    Backend, BackendRef, ExpertPool, Fence, HostData, HostExpert, HostTensor, Result, Tensor, Wrapper,
};
use osprey_backend_cpu::CpuBackend;
use osprey_models::layers::predict;
use osprey_models::{CausalLm, LoadOptions, LogitsWanted, Positions, SeqInput, SeqStep};

/// The CPU backend with deferred fences and a slot-reuse check.
#[derive(Debug)]
struct Deferred {
    inner: BackendRef,
    /// Ops issued so far (a fence is the count when it was recorded).
    issued: AtomicU64,
    /// Fences up to this one have completed.
    done: Arc<AtomicU64>,
    /// (layer, slot) → the issue count of the last op that read it.
    readers: Mutex<HashMap<(u32, usize), u64>>,
    /// Uploads into a slot whose last reader had not completed.
    violations: AtomicUsize,
    /// RAM leases released before their upload's fence completed.
    early_releases: Arc<AtomicUsize>,
    /// The leases of uploads whose fence may not have completed, kept until it has.
    leases: Mutex<Vec<LeaseWatch>>,
    /// Host copies (by address of their elements) → the issue count of the download that fills them.
    copies: Mutex<HashMap<usize, u64>>,
    /// Host copies read before their download's fence completed.
    early_reads: AtomicUsize,
    /// A small LCG: now and then the device catches up with part of the queue.
    rng: AtomicU64,
}

/// A RAM lease that checks, when released, that the upload it was handed with has completed.
#[derive(Debug)]
struct LeaseWatch {
    inner: Option<Box<dyn std::fmt::Debug + Send + Sync>>,
    fence: u64,
    done: Arc<AtomicU64>,
    early: Arc<AtomicUsize>,
}

impl Drop for LeaseWatch {
    fn drop(&mut self) {
        if self.done.load(Ordering::SeqCst) < self.fence {
            self.early.fetch_add(1, Ordering::SeqCst);
        }
        drop(self.inner.take());
    }
}

impl Deferred {
    fn done_handle(&self) -> Arc<AtomicU64> {
        self.done.clone()
    }

    fn new(inner: BackendRef) -> Self {
        Deferred {
            inner,
            issued: AtomicU64::new(0),
            done: Arc::new(AtomicU64::new(0)),
            readers: Mutex::new(HashMap::new()),
            violations: AtomicUsize::new(0),
            early_releases: Arc::new(AtomicUsize::new(0)),
            leases: Mutex::new(Vec::new()),
            copies: Mutex::new(HashMap::new()),
            early_reads: AtomicUsize::new(0),
            rng: AtomicU64::new(12345),
        }
    }

    /// Issues one op; sometimes completes an older part of the queue (never the newest op).
    fn issue(&self) -> u64 {
        let n = self.issued.fetch_add(1, Ordering::SeqCst) + 1;
        let r = self.rng.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::SeqCst).wrapping_mul(6364136223846793005);
        if r >> 61 == 0 {
            self.done.fetch_max(n.saturating_sub(1 + (r >> 40) % 4), Ordering::SeqCst);
        }
        n
    }
}

/// Where a host copy's elements live (what identifies it between its download and its upload).
fn address(h: &HostTensor) -> usize {
    match h.data.as_data() {
        HostData::F32(v) => v.as_ptr() as usize,
        HostData::Bf16(v) | HostData::F16(v) => v.as_ptr() as usize,
        HostData::U8(v) => v.as_ptr() as usize,
        HostData::I32(v) => v.as_ptr() as usize,
    }
}

impl Wrapper for Deferred {
    fn inner(&self) -> &dyn Backend {
        self.inner.as_ref()
    }
    fn describe(&self) -> String {
        format!("deferred-fence {}", self.inner.describe())
    }
    fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, mut expert: HostExpert, after: Fence) -> Result<Fence> {
        // The copy must be ordered after the slot's last reader: done already, or named by `after`.
        let last = self.readers.lock().expect("lock").get(&(pool.layer, slot)).copied().unwrap_or(0);
        if last > self.done.load(Ordering::SeqCst) && last > after.0 {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
        // The copy is queued: the RAM lease must outlive its fence (the slot keeps it until reused).
        let fence = self.issue();
        let watch = LeaseWatch {
            inner: expert.lease.take(),
            fence,
            done: self.done_handle(),
            early: self.early_releases.clone(),
        };
        let mut leases = self.leases.lock().expect("lock");
        let done = self.done.load(Ordering::SeqCst);
        leases.retain(|l| l.fence > done);
        leases.push(watch);
        drop(leases);
        self.inner.upload_expert(pool, slot, expert, after)?;
        Ok(Fence(fence))
    }
    fn moe_routed(&self, x: &Tensor, slots: &[i32], w: &Tensor, pool: &ExpertPool, out: &mut Tensor) -> Result<()> {
        let n = self.issue();
        let mut readers = self.readers.lock().expect("lock");
        for &s in slots.iter().filter(|&&s| s >= 0) {
            readers.insert((pool.layer, s as usize), n);
        }
        drop(readers);
        self.inner.moe_routed(x, slots, w, pool, out)
    }
    fn moe_combine(&self, partials: &Tensor, k: usize) -> Result<Tensor> {
        self.issue();
        self.inner.moe_combine(partials, k)
    }
    fn download_host(&self, t: &Tensor) -> Result<HostTensor> {
        // The copy into host memory is queued: it is readable once its fence has completed.
        let n = self.issue();
        let h = HostTensor { shape: t.shape().to_vec(), data: self.inner.download(t)? };
        self.copies.lock().expect("lock").insert(address(&h), n);
        Ok(h)
    }
    fn upload_host(&self, h: &HostTensor) -> Result<Tensor> {
        let filled = self.copies.lock().expect("lock").get(&address(h)).copied().unwrap_or(0);
        if filled > self.done.load(Ordering::SeqCst) {
            self.early_reads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.upload(h.data.as_data(), &h.shape)
    }
    fn record_fence(&self) -> Fence {
        Fence(self.issued.load(Ordering::SeqCst))
    }
    fn wait_fence(&self, fence: Fence) -> Result<()> {
        self.done.fetch_max(fence.0, Ordering::SeqCst);
        Ok(())
    }
}

fn run(m: &dyn CausalLm, st: &mut osprey_models::SeqState, ids: &[u32]) -> Vec<f32> {
    let input = SeqInput { tokens: ids, positions: Positions::Text, injected: &[], logits: LogitsWanted::Last };
    m.forward(&mut [SeqStep { state: st, input }], false).expect("forward").logits.remove(0)
}

/// One slot per layer (every step reuses slots in waves), then two and four with guesses uploaded ahead (issue 36:
/// the next layer's router, two experts beyond top-k, uploaded while the layer before computes, into
/// slots whose last readers may still be queued).
#[test]
fn no_slot_is_overwritten_before_its_last_reader_completes() {
    for name in ["qwen3_5_moe-tiny", "qwen4_exp-tiny"] {
        for (slots, uploads) in [(1, false), (2, true), (4, true)] {
            let dir = common::fixtures().join("models").join(name);
            let cfg = osprey_models::ModelConfig::from_dir(&dir).expect("config");
            let ck = osprey_models::Checkpoint::open(&dir).expect("checkpoint");
            let deferred = Arc::new(Deferred::new(CpuBackend::shared()));
            let opts = LoadOptions {
                expert_slots: Some(slots),
                predictor: uploads.then(|| predict::by_name("union", 2).expect("policy")).flatten(),
                guess_uploads: uploads,
                ..LoadOptions::default()
            };
            let model =
                osprey_models::load_with_options(&cfg, &ck, opts, deferred.clone(), &mut |_, _| {}).expect("load");
            let reference = osprey_models::load_on(&dir, CpuBackend::shared()).expect("reference");
            let (mut st, mut want) = (model.new_state(), reference.new_state());
            let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 1000).collect();
            let mut next = prompt.clone();
            let what = format!("{name}, {slots} slots, guesses uploaded: {uploads}");
            for step in 0..6 {
                let got = run(&model, &mut st, &next);
                assert!(got == run(&reference, &mut want, &next), "{what}, step {step}: the same bits");
                let t =
                    got.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("logits");
                next = vec![t];
            }
            let stats = model.slot_stats();
            assert!(stats.misses > 0, "{what}: slots were reused");
            assert_eq!(stats.guesses > 0, uploads, "{what}: guesses went up");
            assert_eq!(deferred.violations.load(Ordering::SeqCst), 0, "{what}: a slot was overwritten while read");
            // The device drains its queue, then the model's slots release the leases they still hold.
            deferred.wait_fence(deferred.record_fence()).expect("drain");
            drop(model);
            deferred.leases.lock().expect("lock").clear();
            assert_eq!(
                deferred.early_releases.load(Ordering::SeqCst),
                0,
                "{what}: a RAM lease ended before its upload"
            );
        }
    }
}

#[test]
fn no_snapshot_is_read_before_its_copy_completes() {
    for name in ["qwen3_5_moe-tiny", "qwen4_exp-tiny"] {
        let dir = common::fixtures().join("models").join(name);
        let deferred = Arc::new(Deferred::new(CpuBackend::shared()));
        let model = osprey_models::load_on(&dir, deferred.clone()).expect("load");
        let reference = osprey_models::load_on(&dir, CpuBackend::shared()).expect("reference");
        let (mut st, mut want) = (model.new_state(), reference.new_state());
        let prompt: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % 1000).collect();
        assert_eq!(run(&model, &mut st, &prompt), run(&reference, &mut want, &prompt), "{name}: prompt");
        // Restored at once (the copy is still queued), then again after a few steps past it: both
        // restores must give the reference's next logits.
        let snap = st.snapshot(deferred.as_ref()).expect("snapshot");
        st.restore(&snap, deferred.as_ref()).expect("restore at once");
        let steps = [3u32, 141, 59];
        let first: Vec<Vec<f32>> = steps.iter().map(|&t| run(&model, &mut st, &[t])).collect();
        let expected: Vec<Vec<f32>> = steps.iter().map(|&t| run(&reference, &mut want, &[t])).collect();
        assert_eq!(first, expected, "{name}: decoding after a restore at once");
        st.restore(&snap, deferred.as_ref()).expect("restore later");
        let again: Vec<Vec<f32>> = steps.iter().map(|&t| run(&model, &mut st, &[t])).collect();
        assert_eq!(again, expected, "{name}: decoding again from the snapshot");
        assert_eq!(deferred.early_reads.load(Ordering::SeqCst), 0, "{name}: a snapshot was read before its copy");
    }
}
