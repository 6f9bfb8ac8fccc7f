//! `osprey bench experts`: decode with routed experts streamed from disk under a RAM budget, and the
//! eviction policies compared on the routing trace that run recorded.

use std::path::Path;
use std::sync::{Arc, Mutex};

use osprey_experts::{
    open_reader, spawn, Budget, ExpertIndex, Options, Policy, PrefetchStats, ResidencyStats, ResidencyTable,
    ResidentSet,
};
use osprey_models::backend::BackendRef;
use osprey_models::layers::predict::{Calibrated, ExpertPredictor};
use osprey_models::{
    Checkpoint, ExpertKey, ExpertSource, ExpertTicket, ExpertWeights, Guess, LayerStep, ModelConfig, PendingExperts,
    Weight,
};
use osprey_runner::{Driver, GenerateOptions, NoMedia};
use serde::Serialize;

/// A routing trace: per MoE request, the layer and the experts it routed to.
type Trace = Vec<(usize, Vec<usize>)>;

/// Records every request (the routing trace) and forwards it.
#[derive(Debug)]
struct Recording {
    inner: Arc<dyn ExpertSource>,
    trace: Arc<Mutex<Trace>>,
    /// Baseline: hand the model no resident expert early, so it computes routed experts only once all of
    /// the layer's are in RAM (what the runner did before overlapping resident experts with the reads).
    wait_all: bool,
}

impl ExpertSource for Recording {
    fn slots_per_layer(&self) -> Option<usize> {
        self.inner.slots_per_layer()
    }

    fn guess(&self, guess: Guess<'_>) -> PendingExperts {
        self.inner.guess(guess)
    }

    /// A MoE step's slot hits and misses make one trace entry: every expert the step routed to.
    fn request(&self, step: LayerStep<'_>) -> ExpertTicket {
        if let (Ok(mut t), Some(first)) = (self.trace.lock(), step.need.iter().chain(step.in_slots).next()) {
            let mut experts: Vec<usize> = step.need.iter().chain(step.in_slots).map(|k| k.expert()).collect();
            experts.sort_unstable();
            t.push((first.layer(), experts));
        }
        let ticket = self.inner.request(step);
        if !self.wait_all {
            return ticket;
        }
        let n = step.need.len();
        ExpertTicket::new(move || Ok(((0..n).map(|_| None).collect(), PendingExperts::new(move || ticket.wait()))))
    }
}

/// A recorded routing trace as a file: what `bench experts --trace-out` writes and `bench replay` reads.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TraceFile {
    /// MoE layers.
    pub layers: usize,
    /// Routed experts per layer.
    pub experts_per_layer: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Per MoE request, in order: the layer and the experts it routed to.
    pub trace: Vec<(usize, Vec<usize>)>,
}

/// The policies' hit rates on a recorded trace at each budget (a fraction of all experts), without
/// running the model.
pub fn replay(t: &TraceFile, fractions: &[f64]) -> Vec<(f64, PolicyHitRates)> {
    fractions
        .iter()
        .map(|&f| {
            let capacity = ((t.layers * t.experts_per_layer) as f64 * f) as usize;
            (f, simulate(&t.trace, t.layers, t.experts_per_layer, capacity.max(t.top_k)))
        })
        .collect()
}

/// Hit rate of each policy on a trace (warm-up on the first half, measured on the second).
#[derive(Clone, Debug, Serialize)]
pub struct PolicyHitRates {
    /// Least recently used.
    pub lru: f64,
    /// LFU with decay (half-life 64 accesses per layer).
    pub lfu_decay: f64,
    /// Static routing-frequency profile from the first half (evict the rarest).
    pub profile: f64,
}

/// One budget's run.
#[derive(Clone, Debug, Serialize)]
pub struct ExpertsReport {
    /// Budget as a fraction of all expert bytes.
    pub budget_fraction: f64,
    /// Budget in bytes.
    pub budget_bytes: u64,
    /// RAM all routed experts would take resident (aligned read windows).
    pub expert_bytes: u64,
    /// Reader used.
    pub reader: String,
    /// Decode tokens per second.
    pub decode_tok_s: f64,
    /// Seconds from the prompt's arrival to its first token (the prompt's experts read cold, or warmed).
    pub prefill_secs: f64,
    /// Seconds the warm-up took before the prompt (with `warmup`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_secs: Option<f64>,
    /// Fraction of expert accesses served from RAM during decode.
    pub residency: f64,
    /// Expert bytes read per decode token.
    pub bytes_read_per_token: f64,
    /// Achieved read throughput during read batches.
    pub read_gb_s: f64,
    /// Seconds the runner waited for experts during decode (after the shared expert).
    pub stall_s: f64,
    /// Peak resident set of the process (VmHWM).
    pub peak_rss_bytes: u64,
    /// Policies on the recorded trace at this budget.
    pub policies: PolicyHitRates,
    /// Baseline run: routed experts computed only after all of a layer's were in RAM.
    pub wait_all: bool,
    /// PLE row budget as a fraction of the tables' rows (models with PLE, `qwen4_exp`; else absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ple_budget_fraction: Option<f64>,
    /// Fraction of PLE row lookups served from RAM during decode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ple_residency: Option<f64>,
    /// PLE table bytes read per decode token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ple_bytes_read_per_token: Option<f64>,
    /// Read-ahead during decode.
    pub prefetch: PrefetchReport,
}

/// What reading ahead did during decode.
#[derive(Clone, Debug, Serialize)]
pub struct PrefetchReport {
    /// The policy (`off`, `router (margin 2)`, `oracle`, …).
    pub policy: String,
    /// Guessed experts read per token.
    pub issued_per_token: f64,
    /// Of the guesses read, the fraction their layer used (precision of what was read).
    pub used_fraction: f64,
    /// Bytes read for guesses that were not used, per token.
    pub wasted_bytes_per_token: f64,
    /// Guesses not read (held already, or over the cap), per token.
    pub skipped_per_token: f64,
    /// Guesses dropped before their read was submitted (their layer came first), per token.
    pub cancelled_per_token: f64,
    /// Guesses not read for a measured precision below the disk's break-even, per token.
    pub gated_per_token: f64,
    /// Milliseconds demand reads waited behind a guess being read, per token.
    pub demand_delay_ms_per_token: f64,
    /// Per MoE layer, the policy's guesses against what the layer then routed to, every step of the run
    /// (prefill included; whether or not a guess was read).
    pub per_layer: Vec<GuessAccuracy>,
}

/// A policy's guesses for one layer against its routing.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct GuessAccuracy {
    /// Guessed experts the layer routed to, over the experts guessed.
    pub precision: f64,
    /// Routed experts that were guessed, over the experts routed to.
    pub recall: f64,
    /// Steps scored.
    pub steps: u64,
}

/// Per layer: (true positives, guessed, routed, steps).
type Tally = Vec<(u64, u64, u64, u64)>;

/// Wraps a policy and scores each guess when its layer reports its routing.
#[derive(Debug)]
struct Scored {
    inner: Arc<dyn ExpertPredictor>,
    /// Per layer: the pending guess; and the tally.
    state: Mutex<(Vec<Option<Vec<ExpertKey>>>, Tally)>,
}

impl Scored {
    fn new(inner: Arc<dyn ExpertPredictor>, layers: usize) -> Self {
        Scored { inner, state: Mutex::new((vec![None; layers], vec![(0, 0, 0, 0); layers])) }
    }

    fn accuracy(&self) -> Vec<GuessAccuracy> {
        let st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        st.1.iter()
            .map(|&(tp, guessed, routed, steps)| GuessAccuracy {
                precision: tp as f64 / guessed.max(1) as f64,
                recall: tp as f64 / routed.max(1) as f64,
                steps,
            })
            .collect()
    }
}

impl ExpertPredictor for Scored {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        {
            let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let (pending, score) = &mut *st;
            if let Some(guess) = pending.get_mut(layer).and_then(Option::take) {
                let tp = guess.iter().filter(|k| touched.contains(k)).count() as u64;
                let s = &mut score[layer];
                *s = (s.0 + tp, s.1 + guess.len() as u64, s.2 + touched.len() as u64, s.3 + 1);
            }
        }
        self.inner.observe(layer, touched);
    }

    fn predict(&self, a: &osprey_models::layers::predict::Ahead<'_>) -> osprey_models::Result<Vec<ExpertKey>> {
        Ok(self.predict_scored(a)?.into_iter().map(|(k, _)| k).collect())
    }

    fn predict_scored(
        &self,
        a: &osprey_models::layers::predict::Ahead<'_>,
    ) -> osprey_models::Result<Vec<(ExpertKey, f32)>> {
        let guess = self.inner.predict_scored(a)?;
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = st.0.get_mut(a.next) {
            *p = Some(guess.iter().map(|&(k, _)| k).collect());
        }
        Ok(guess)
    }
}

impl PrefetchReport {
    fn new(
        p: &Prefetch,
        (before, after): (&PrefetchStats, &PrefetchStats),
        tokens: usize,
        scored: Option<&Scored>,
    ) -> Self {
        let per = |a: u64, b: u64| a.saturating_sub(b) as f64 / tokens.max(1) as f64;
        let issued = after.issued.saturating_sub(before.issued);
        PrefetchReport {
            policy: p.name(),
            issued_per_token: per(after.issued, before.issued),
            used_fraction: after.used.saturating_sub(before.used) as f64 / issued.max(1) as f64,
            wasted_bytes_per_token: per(after.wasted_bytes, before.wasted_bytes),
            skipped_per_token: per(after.skipped, before.skipped),
            cancelled_per_token: per(after.cancelled, before.cancelled),
            gated_per_token: per(after.gated, before.gated),
            demand_delay_ms_per_token: per(after.demand_delay_us, before.demand_delay_us) / 1e3,
            per_layer: scored.map(Scored::accuracy).unwrap_or_default(),
        }
    }
}

/// The model's PLE counters: (hits, misses, bytes read).
fn ple_counts(budget: &osprey_models::PleBudget) -> (u64, u64, u64) {
    let s = budget.counts();
    (s.hits, s.misses, s.bytes_read)
}

fn stats(set: &ResidentSet) -> ResidencyStats {
    set.stats().unwrap_or_default()
}

fn totals(s: &ResidencyStats) -> (u64, u64, u64, f64) {
    s.layers
        .iter()
        .fold((0, 0, 0, 0.0), |(h, m, b, t), l| (h + l.hits, m + l.misses, b + l.bytes_read, t + l.read_secs))
}

fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .unwrap_or(0)
        * 1024
}

fn simulate(trace: &Trace, layers: usize, per_layer_experts: usize, capacity: usize) -> PolicyHitRates {
    let dummy = {
        let m = Weight::from_f32(1, 1, vec![0.0]);
        Arc::new(ExpertWeights { gate: m.clone(), up: m.clone(), down: m })
    };
    let half = trace.len() / 2;
    let run = |policy: Policy, profile: Option<&Vec<f64>>| -> f64 {
        let mut t = ResidencyTable::new(layers, Budget::Bytes(capacity), policy);
        let (mut hits, mut total) = (0u64, 0u64);
        for (i, (layer, experts)) in trace.iter().enumerate() {
            for &e in experts {
                let key = ExpertKey::new(*layer, e);
                let hit = t.lease(key).is_some();
                if !hit {
                    t.insert(key, dummy.clone(), 1);
                }
                if let Some(p) = profile {
                    t.set_frequency(key, p[layer * per_layer_experts + e]);
                }
                if i >= half {
                    total += 1;
                    hits += hit as u64;
                }
            }
            for &e in experts {
                t.release(ExpertKey::new(*layer, e));
            }
        }
        hits as f64 / total.max(1) as f64
    };
    let mut freq = vec![0f64; layers * per_layer_experts];
    for (layer, experts) in &trace[..half] {
        for &e in experts {
            freq[layer * per_layer_experts + e] += 1.0;
        }
    }
    // A static profile is LFU whose counts never change: decay off, counts set from the first half.
    PolicyHitRates {
        lru: run(Policy::Lru, None),
        lfu_decay: run(Policy::LfuDecay { half_life: 64 }, None),
        profile: run(Policy::LfuDecay { half_life: u32::MAX }, Some(&freq)),
    }
}

/// One `bench experts` run: expert and PLE budgets as fractions of their bytes, the prompt and decode
/// lengths, and `wait_all` (the no-overlap baseline, see [`Recording`]).
#[derive(Clone, Debug)]
pub struct ExpertsRun {
    /// Expert RAM budget, a fraction of every expert's bytes.
    pub fraction: f64,
    /// PLE row caches' budget, a fraction of the tables' rows (models with PLE).
    pub ple_fraction: f64,
    /// Prompt tokens prefilled.
    pub prompt_len: usize,
    /// Tokens decoded after it.
    pub decode_tokens: usize,
    /// Wait for every expert before computing (no overlap).
    pub wait_all: bool,
    /// Let the residency manager warm its budget up before the prompt (`--expert-warmup`), as a server
    /// that has been up a while has.
    pub warmup: bool,
    /// What is read ahead.
    pub prefetch: Prefetch,
    /// MoE layers ahead each layer guesses (1: the next).
    pub prefetch_depth: usize,
}

/// What `bench experts` reads ahead (`--prefetch`).
#[derive(Clone, Debug, Default)]
pub enum Prefetch {
    /// Nothing: each layer's misses are read when the layer asks.
    #[default]
    Off,
    /// A policy by name (`router`, `previous`, `union`) and the router's margin (`--expert-prefetch`).
    Policy(String, usize),
    /// Exactly the next layer's experts, from a trace of the same prompt: the pipeline's own ceiling.
    Oracle(TraceFile),
    /// As many experts as the oracle guesses, none of which the next layer routes to (the trace's
    /// complement): what a wrong guess costs. Scored by [`Calibrated`] (`wrong`), its measured precision
    /// falls to 0 and the gate stops reading it; unscored (`wrong-unscored`, every guess claimed sure), it
    /// is read with the widest window whenever the disk is idle.
    Wrong(TraceFile, bool),
}

impl Prefetch {
    /// Its name in reports.
    pub fn name(&self) -> String {
        match self {
            Prefetch::Off => "off".into(),
            Prefetch::Policy(n, m) => format!("{n} (margin {m})"),
            Prefetch::Oracle(_) => "oracle".into(),
            Prefetch::Wrong(_, true) => "wrong".into(),
            Prefetch::Wrong(_, false) => "wrong-unscored".into(),
        }
    }

    fn predictor(&self) -> crate::Result<Option<Arc<dyn ExpertPredictor>>> {
        Ok(match self {
            Prefetch::Off => None,
            Prefetch::Policy(n, m) => osprey_models::layers::predict::by_name(n, *m)?,
            Prefetch::Oracle(t) => Some(Arc::new(osprey_models::layers::predict::Replay::new(t.trace.clone()))),
            Prefetch::Wrong(t, scored) => {
                let k = t.top_k.max(1);
                // Per step, `k` experts of the layer it does not route to (as many as the oracle guesses
                // at a decode step), starting after its last routed one so they vary.
                let wrong = t.trace.iter().map(|(l, routed)| {
                    let start = routed.iter().max().map_or(0, |m| m + 1);
                    let others = (0..t.experts_per_layer).map(|i| (start + i) % t.experts_per_layer);
                    (*l, others.filter(|e| !routed.contains(e)).take(k).collect())
                });
                let replay: Arc<dyn ExpertPredictor> =
                    Arc::new(osprey_models::layers::predict::Replay::new(wrong.collect()));
                Some(if *scored { Arc::new(Calibrated::new(replay)) } else { replay })
            }
        })
    }

    fn margin(&self) -> usize {
        match self {
            Prefetch::Policy(_, m) => *m,
            _ => 0,
        }
    }
}

/// Prefills then decodes as `run` says with the model on `backend` and its experts streamed from disk.
pub fn bench_experts(dir: &Path, run: ExpertsRun, backend: BackendRef) -> crate::Result<ExpertsReport> {
    bench_experts_traced(dir, run, backend).map(|(r, _)| r)
}

/// [`bench_experts`], also returning the routing trace the run recorded.
pub fn bench_experts_traced(
    dir: &Path,
    run: ExpertsRun,
    backend: BackendRef,
) -> crate::Result<(ExpertsReport, TraceFile)> {
    let ExpertsRun { fraction, ple_fraction, prompt_len, decode_tokens, wait_all, warmup, prefetch, prefetch_depth } =
        run;
    let cfg = ModelConfig::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    let layout = osprey_models::expert_layout(&cfg, &ck)?
        .ok_or_else(|| osprey_models::Error::Unsupported("bench experts needs a MoE model".into()))?;
    let prefixes = &layout.prefixes;
    let index = ExpertIndex::build(&ck, prefixes, layout.num_experts, layout.hidden, layout.intermediate)?;
    // Budgets are RAM: what a resident expert really takes (aligned read windows), not its tensor bytes.
    let per_expert = index.expert_footprint(ExpertKey::new(0, 0));
    let total = per_expert * layout.num_experts * prefixes.len();
    let budget_bytes = (total as f64 * fraction) as usize;
    let reader = open_reader(&index.files, None)
        .map_err(|source| osprey_models::Error::Io { path: dir.to_path_buf(), source })?;
    let reader_kind = format!("{:?}", reader.kind());
    let scored = prefetch.predictor()?.map(|p| Arc::new(Scored::new(p, prefixes.len())));
    let predictor = scored.clone().map(|s| s as Arc<dyn ExpertPredictor>);
    let top_k = cfg.text.moe()?.map_or(0, |m| m.top_k);
    let prefetch_cap = match predictor {
        Some(_) => Options::prefetch_cap_for(&index, top_k, prefetch.margin(), prefetch_depth),
        None => 0,
    };
    let opts = Options { warmup, prefetch_cap };
    let set = spawn(index, reader, (Budget::Bytes(budget_bytes), Policy::Lru), opts, backend.as_ref());
    let tx = set.clone();
    // The warm-up is done when no further expert fits (every expert takes one footprint).
    let t_warm = std::time::Instant::now();
    while warmup && (stats(&tx).resident_bytes as usize + per_expert) <= budget_bytes {
        std::thread::sleep(std::time::Duration::from_millis(20)); // a benchmark's wait, not a test's
    }
    let warmup_secs = warmup.then(|| t_warm.elapsed().as_secs_f64());
    let trace = Arc::new(Mutex::new(Vec::new()));
    let source = Arc::new(Recording { inner: Arc::new(set), trace: trace.clone(), wait_all });
    let ple_budget = osprey_models::PleBudget::default();
    let opts = osprey_models::LoadOptions {
        experts: Some(source),
        ple_budget: ple_budget.clone(),
        predictor,
        prefetch_depth,
        ..osprey_models::LoadOptions::default()
    };
    let model = osprey_models::load_with_options(&cfg, &ck, opts, backend, &mut |_, _| {})?;
    // The tables' size is known once they are open: the budget is a fraction of it.
    let ple_rows = ple_budget.counts().table_row_bytes;
    if ple_rows > 0 {
        ple_budget.set((ple_rows as f64 * ple_fraction) as u64);
    }
    let prompt = crate::text_prompt(crate::bench_prompt(prompt_len, model.info().vocab_size));
    let mut driver = Driver::new(model, 16);
    // Counters are sampled at the first token, so they cover the decode only.
    let (mut before, mut ple_before) = (None, (0, 0, 0));
    let opts = GenerateOptions { chunk: prompt_len.max(1), max_tokens: decode_tokens + 1, stop_token_ids: Vec::new() };
    let g = driver.generate_observed(prompt, crate::greedy(), &opts, &mut NoMedia, &mut || {
        before = Some(stats(&tx));
        ple_before = ple_counts(&ple_budget);
    })?;
    let before = before.unwrap_or_default();
    let ple_after = ple_counts(&ple_budget);
    let (ph, pm, pb) = (ple_after.0 - ple_before.0, ple_after.1 - ple_before.1, ple_after.2 - ple_before.2);
    let secs = g.decode_secs;
    let after = stats(&tx);
    let (h0, m0, b0, r0) = totals(&before);
    let (h1, m1, b1, r1) = totals(&after);
    let (hits, misses, bytes, read_s) = (h1 - h0, m1 - m0, b1 - b0, r1 - r0);
    let trace = trace.lock().map(|t| t.clone()).unwrap_or_default();
    let capacity_experts = budget_bytes / per_expert.max(1);
    let file = TraceFile { layers: prefixes.len(), experts_per_layer: layout.num_experts, top_k, trace: trace.clone() };
    let report = ExpertsReport {
        budget_fraction: fraction,
        budget_bytes: budget_bytes as u64,
        expert_bytes: total as u64,
        reader: reader_kind,
        decode_tok_s: decode_tokens as f64 / secs,
        prefill_secs: g.prefill_secs,
        warmup_secs,
        residency: hits as f64 / (hits + misses).max(1) as f64,
        bytes_read_per_token: bytes as f64 / decode_tokens.max(1) as f64,
        read_gb_s: if read_s > 0.0 { bytes as f64 / read_s / 1e9 } else { 0.0 },
        stall_s: after.stall_secs - before.stall_secs,
        peak_rss_bytes: peak_rss(),
        policies: simulate(&trace, prefixes.len(), layout.num_experts, capacity_experts.max(top_k)),
        wait_all,
        ple_budget_fraction: (ple_rows > 0).then_some(ple_fraction),
        ple_residency: (ple_rows > 0).then(|| ph as f64 / (ph + pm).max(1) as f64),
        ple_bytes_read_per_token: (ple_rows > 0).then(|| pb as f64 / decode_tokens.max(1) as f64),
        prefetch: PrefetchReport::new(&prefetch, (&before.prefetch, &after.prefetch), decode_tokens, scored.as_deref()),
    };
    Ok((report, file))
}

/// The disk's random-read bandwidth over a model's safetensors files, measured the way expert misses
/// read (the experts' reader: io_uring with O_DIRECT, else pread): batches of 16 reads of 512 KiB at
/// seeded offsets for about `secs` seconds. GB/s; the upper bound on expert streaming.
pub fn measure_disk_read(dir: &Path, secs: f64) -> std::io::Result<f64> {
    use osprey_experts::ReadReq;
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let sizes: Vec<u64> = files.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)).collect();
    let chunk = 512usize << 10;
    let usable: Vec<usize> = (0..files.len()).filter(|&i| sizes[i] > chunk as u64).collect();
    if usable.is_empty() {
        return Ok(0.0);
    }
    let mut reader = open_reader(&files, None)?;
    let (mut state, mut bytes) = (0x1234_5678_9abc_def0u64, 0u64);
    let t0 = std::time::Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        let reqs: Vec<ReadReq> = (0..16)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let f = usable[(state >> 33) as usize % usable.len()];
                let blocks = (sizes[f] - chunk as u64) / 4096;
                ReadReq { file: f, offset: ((state >> 11) % blocks.max(1)) * 4096, len: chunk }
            })
            .collect();
        for r in reader.read_batch(&reqs) {
            bytes += r.map(|_| chunk as u64)?;
        }
    }
    Ok(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9)
}
