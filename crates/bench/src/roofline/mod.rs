//! `osprey bench roofline`: a speed model of the CUDA backend on a named card (issue 51, item 6). No GPU
//! is lent to this project, so a step's time on a card is modelled from what the emulated device
//! measures, launch by launch: the global-memory bytes each kernel moves (`emu/traffic.cpp`), the
//! arithmetic it declares (`// flops:` in its source), its launches, the host waits and the bytes over
//! PCIe. Each kernel is priced at `max(bytes / bandwidth, FLOPs / peak of its path)` plus a launch overhead
//! per launch (eager, or inside a CUDA graph), each host wait at a round trip, each copy at the link's
//! bandwidth. The roofline is the bytes a step must move (the distinct bytes of each window between host
//! waits: weights touched once, KV, recurrent state) over the card's bandwidth; the model's fraction of it
//! is how far the backend is from the card's speed.
//!
//! A card's figures come from its vendor's datasheet (dense, no sparsity; tensor-core peaks at FP32
//! accumulation); launch and wait costs are the usual measured orders of magnitude on Linux, the same for
//! every card (docs/cuda.md, "Speed model").

mod run;

use serde::Serialize;

use osprey_models::backend::DeviceStats;

pub use run::{head_only, measure, RooflineBench, PAGE};

/// A card the model prices on.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Card {
    /// Its name (`rtx-4090`).
    pub name: &'static str,
    /// DRAM bandwidth, GB/s.
    pub bandwidth_gb_s: f64,
    /// FP32 CUDA-core peak, TFLOPS.
    pub fp32_tflops: f64,
    /// bf16 tensor-core peak with FP32 accumulation, dense, TFLOPS.
    pub bf16_tflops: f64,
    /// int8 tensor-core peak, dense, TOPS.
    pub int8_tops: f64,
    /// Host link bandwidth one way, GB/s (PCIe 4.0 x16 ≈ 25 in practice, 5.0 ≈ 50).
    pub pcie_gb_s: f64,
}

/// Launch and wait costs, the same on every card: a kernel launched eagerly from one stream costs the
/// device ~4 µs between kernels when the host keeps up, ~1 µs as a node of a replayed CUDA graph; a host
/// wait (a synchronise, a blocking copy) drains the queue and costs ~10 µs before the device runs again.
pub const LAUNCH_US: f64 = 4.0;
/// See [`LAUNCH_US`].
pub const GRAPH_LAUNCH_US: f64 = 1.0;
/// See [`LAUNCH_US`].
pub const HOST_WAIT_US: f64 = 10.0;

/// The cards of docs/cuda.md's table (a test holds the two equal).
pub const CARDS: &[Card] = &[
    Card {
        name: "rtx-3090",
        bandwidth_gb_s: 936.0,
        fp32_tflops: 35.6,
        bf16_tflops: 71.0,
        int8_tops: 284.0,
        pcie_gb_s: 25.0,
    },
    Card {
        name: "rtx-4090",
        bandwidth_gb_s: 1008.0,
        fp32_tflops: 82.6,
        bf16_tflops: 165.2,
        int8_tops: 660.6,
        pcie_gb_s: 25.0,
    },
    Card {
        name: "rtx-5090",
        bandwidth_gb_s: 1792.0,
        fp32_tflops: 104.8,
        bf16_tflops: 209.5,
        int8_tops: 838.0,
        pcie_gb_s: 50.0,
    },
    Card {
        name: "l4",
        bandwidth_gb_s: 300.0,
        fp32_tflops: 30.3,
        bf16_tflops: 121.0,
        int8_tops: 242.5,
        pcie_gb_s: 25.0,
    },
    Card {
        name: "a100-80gb",
        bandwidth_gb_s: 2039.0,
        fp32_tflops: 19.5,
        bf16_tflops: 312.0,
        int8_tops: 624.0,
        pcie_gb_s: 25.0,
    },
    Card {
        name: "h100-sxm",
        bandwidth_gb_s: 3350.0,
        fp32_tflops: 67.0,
        bf16_tflops: 989.4,
        int8_tops: 1979.0,
        pcie_gb_s: 50.0,
    },
];

/// The card named `name`.
pub fn card(name: &str) -> Option<Card> {
    CARDS.iter().copied().find(|c| c.name == name)
}

/// One kernel's share of a stretch of work.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct KernelWork {
    /// The kernel (`cublasGemmEx`, `memcpy`, `memset` included).
    pub name: String,
    /// Launches.
    pub launches: f64,
    /// FLOPs on FP32 cores, bf16 tensor cores, int8.
    pub flops: [f64; 3],
    /// Distinct global bytes read and written, launch by launch.
    pub bytes: [f64; 2],
}

/// What a stretch of work (a decode step, a prefill) asked of the device.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Work {
    /// Per kernel, most bytes first.
    pub kernels: Vec<KernelWork>,
    /// Host waits.
    pub host_waits: f64,
    /// Bytes host → device.
    pub bytes_to_device: f64,
    /// Bytes device → host.
    pub bytes_from_device: f64,
    /// Distinct bytes (read + written) of its windows between host waits: what it must move at least.
    pub must_move: f64,
}

impl Work {
    /// The work between two readings of a metering device, divided by `per` (steps or tokens).
    pub fn between(before: &DeviceStats, after: &DeviceStats, per: usize) -> Work {
        let per = per.max(1) as f64;
        let d = |a: u64, b: u64| a.saturating_sub(b) as f64 / per;
        let kernels = after
            .costs
            .iter()
            .map(|k| {
                let was = before.costs.iter().find(|b| b.name == k.name).cloned().unwrap_or_default();
                let (f, g) = (k.flops, was.flops);
                let (b, c) = (k.bytes.unwrap_or_default(), was.bytes.unwrap_or_default());
                KernelWork {
                    name: k.name.clone(),
                    launches: d(k.launches, was.launches),
                    flops: [d(f.fp32, g.fp32), d(f.bf16, g.bf16), d(f.int8, g.int8)],
                    bytes: [d(b.0, c.0), d(b.1, c.1)],
                }
            })
            .collect();
        let (w, v) = (after.window_bytes.unwrap_or_default(), before.window_bytes.unwrap_or_default());
        let mut work = Work {
            kernels,
            host_waits: d(after.host_waits, before.host_waits),
            bytes_to_device: d(after.bytes_to_device, before.bytes_to_device),
            bytes_from_device: d(after.bytes_from_device, before.bytes_from_device),
            must_move: d(w.0, v.0) + d(w.1, v.1),
        };
        work.tidy();
        work
    }

    /// `self + f · other`, kernel by kernel.
    fn plus(&self, other: &Work, f: f64) -> Work {
        let mut out = self.clone();
        for k in &other.kernels {
            let i = match out.kernels.iter().position(|o| o.name == k.name) {
                Some(i) => i,
                None => {
                    out.kernels.push(KernelWork { name: k.name.clone(), ..KernelWork::default() });
                    out.kernels.len() - 1
                }
            };
            let o = &mut out.kernels[i];
            o.launches += f * k.launches;
            for (a, b) in o.flops.iter_mut().zip(k.flops) {
                *a += f * b;
            }
            for (a, b) in o.bytes.iter_mut().zip(k.bytes) {
                *a += f * b;
            }
        }
        out.host_waits += f * other.host_waits;
        out.bytes_to_device += f * other.bytes_to_device;
        out.bytes_from_device += f * other.bytes_from_device;
        out.must_move += f * other.must_move;
        out.tidy();
        out
    }

    /// Drops kernels with nothing left (a difference's rounding), most bytes first.
    fn tidy(&mut self) {
        self.kernels.retain(|k| k.launches > 1e-9 || k.bytes.iter().chain(&k.flops).any(|v| *v > 0.5));
        self.kernels.sort_by(|a, b| (b.bytes[0] + b.bytes[1]).total_cmp(&(a.bytes[0] + a.bytes[1])));
    }
}

/// A model of `layers` decoder layers and vocabulary `vocab`, from the work of the measured checkpoint
/// (`layers_measured` layers, vocabulary `vocab_measured`) and of the same checkpoint with no layer (the
/// head alone: embedding, final norm, LM head, logits): each layer costs the average of the measured
/// ones (the checkpoint keeps the real model's mix, three Gated DeltaNet layers to one attention layer),
/// and the head's linears, logits and must-move bytes grow with the vocabulary.
pub fn scale(measured: &Work, head: &Work, layers_measured: usize, layers: usize, vocab: (usize, usize)) -> Work {
    let per_layer = measured.plus(head, -1.0);
    let ratio = vocab.1 as f64 / vocab.0.max(1) as f64;
    let mut big_head = head.clone();
    for k in &mut big_head.kernels {
        if k.name.starts_with("linear_") || k.name == "cublasGemmEx" {
            k.flops.iter_mut().chain(k.bytes.iter_mut()).for_each(|v| *v *= ratio);
        }
    }
    big_head.bytes_from_device *= ratio;
    big_head.must_move *= ratio;
    big_head.plus(&per_layer, layers as f64 / layers_measured.max(1) as f64)
}

/// One kernel priced.
#[derive(Clone, Debug, Serialize)]
pub struct KernelTime {
    /// The kernel.
    pub name: String,
    /// Launches.
    pub launches: f64,
    /// Bytes moved (read + written).
    pub bytes: f64,
    /// FLOPs on all paths.
    pub flops: f64,
    /// Seconds: `max(memory, arithmetic)` plus the launches' overhead.
    pub secs: f64,
    /// What bounds it: `memory`, `compute` or `launch` (the overhead exceeds both).
    pub bound: &'static str,
}

/// A stretch of work priced on a card.
#[derive(Clone, Debug, Serialize)]
pub struct Priced {
    /// The card.
    pub card: &'static str,
    /// Launches priced as nodes of a replayed CUDA graph.
    pub graph: bool,
    /// Per kernel, slowest first.
    pub kernels: Vec<KernelTime>,
    /// Seconds of the kernels (overheads included).
    pub kernel_secs: f64,
    /// Seconds of host waits.
    pub wait_secs: f64,
    /// Seconds of copies over PCIe.
    pub copy_secs: f64,
    /// The modelled step: kernels, waits and copies, one after another.
    pub secs: f64,
    /// The roofline: the must-move bytes over the bandwidth.
    pub roofline_secs: f64,
    /// `roofline_secs / secs`: the fraction of the card's speed the step reaches.
    pub fraction: f64,
}

/// Prices `work` on `card` (see the module docs).
pub fn price(work: &Work, card: &Card, graph: bool) -> Priced {
    let bw = card.bandwidth_gb_s * 1e9;
    let peaks = [card.fp32_tflops * 1e12, card.bf16_tflops * 1e12, card.int8_tops * 1e12];
    let per_launch = if graph { GRAPH_LAUNCH_US } else { LAUNCH_US } * 1e-6;
    let mut kernels: Vec<KernelTime> = work
        .kernels
        .iter()
        .map(|k| {
            let bytes = k.bytes[0] + k.bytes[1];
            let memory = bytes / bw;
            let compute: f64 = k.flops.iter().zip(peaks).map(|(f, p)| f / p).sum();
            let overhead = k.launches * per_launch;
            let bound = if overhead > memory.max(compute) {
                "launch"
            } else if compute > memory {
                "compute"
            } else {
                "memory"
            };
            let flops = k.flops.iter().sum();
            KernelTime {
                name: k.name.clone(),
                launches: k.launches,
                bytes,
                flops,
                secs: memory.max(compute) + overhead,
                bound,
            }
        })
        .collect();
    kernels.sort_by(|a, b| b.secs.total_cmp(&a.secs));
    let kernel_secs = kernels.iter().map(|k| k.secs).sum::<f64>();
    let wait_secs = work.host_waits * HOST_WAIT_US * 1e-6;
    let copy_secs = (work.bytes_to_device + work.bytes_from_device) / (card.pcie_gb_s * 1e9);
    let secs = kernel_secs + wait_secs + copy_secs;
    let roofline_secs = work.must_move / bw;
    Priced {
        card: card.name,
        graph,
        kernels,
        kernel_secs,
        wait_secs,
        copy_secs,
        secs,
        roofline_secs,
        fraction: if secs > 0.0 { roofline_secs / secs } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str, launches: f64, flops: f64, bytes: f64) -> KernelWork {
        KernelWork { name: name.into(), launches, flops: [flops, 0.0, 0.0], bytes: [bytes, 0.0] }
    }

    #[test]
    fn a_kernel_costs_the_larger_of_its_bytes_and_its_arithmetic_plus_its_launches() {
        let c = card("rtx-4090").expect("a card");
        // 1 GB at 1008 GB/s is ~0.99 ms; 1 GFLOP at 82.6 TFLOPS is ~12 µs: memory bound.
        let w = Work {
            kernels: vec![kernel("gemv", 1.0, 1e9, 1e9), kernel("norm", 100.0, 1e3, 1e3)],
            host_waits: 2.0,
            must_move: 1e9,
            ..Work::default()
        };
        let p = price(&w, &c, false);
        let gemv = p.kernels.iter().find(|k| k.name == "gemv").expect("priced");
        assert!((gemv.secs - (1e9 / 1008e9 + 4e-6)).abs() < 1e-12 && gemv.bound == "memory");
        let norm = p.kernels.iter().find(|k| k.name == "norm").expect("priced");
        assert!((norm.secs - (1e3 / 1008e9 + 400e-6)).abs() < 1e-12 && norm.bound == "launch");
        assert!((p.wait_secs - 20e-6).abs() < 1e-12);
        assert!((p.roofline_secs - 1e9 / 1008e9).abs() < 1e-15);
        assert!(p.fraction < 1.0 && p.fraction > 0.6, "{}", p.fraction);
        // In a graph, the 100 small launches cost a quarter.
        let g = price(&w, &c, true);
        assert!(g.secs < p.secs && g.kernels.iter().any(|k| k.name == "norm" && (k.secs - 100e-6).abs() < 1e-9));
        // An arithmetic-heavy kernel is compute bound.
        let w = Work { kernels: vec![kernel("tile", 1.0, 1e12, 1e6)], ..Work::default() };
        assert_eq!(price(&w, &c, false).kernels[0].bound, "compute");
    }

    #[test]
    fn a_model_is_its_head_plus_its_layers_at_the_measured_average_and_the_head_grows_with_the_vocabulary() {
        let head = Work {
            kernels: vec![kernel("linear_gemv", 1.0, 10.0, 100.0), kernel("rms_norm_f32", 1.0, 1.0, 8.0)],
            bytes_from_device: 40.0,
            must_move: 100.0,
            ..Work::default()
        };
        // Four measured layers add 4 norms and 4 GEMVs of 50 bytes each.
        let measured = head.plus(
            &Work {
                kernels: vec![kernel("linear_gemv", 1.0, 5.0, 50.0), kernel("rms_norm_f32", 1.0, 1.0, 8.0)],
                host_waits: 1.0,
                must_move: 58.0,
                ..Work::default()
            },
            4.0,
        );
        let s = scale(&measured, &head, 4, 40, (1000, 2000));
        let gemv = s.kernels.iter().find(|k| k.name == "linear_gemv").expect("kept");
        assert_eq!((gemv.launches, gemv.bytes[0], gemv.flops[0]), (41.0, 2.0 * 100.0 + 40.0 * 50.0, 20.0 + 200.0));
        let norm = s.kernels.iter().find(|k| k.name == "rms_norm_f32").expect("kept");
        assert_eq!(
            (norm.launches, norm.bytes[0]),
            (41.0, 8.0 + 40.0 * 8.0),
            "a norm does not grow with the vocabulary"
        );
        assert_eq!((s.host_waits, s.bytes_from_device, s.must_move), (40.0, 80.0, 200.0 + 40.0 * 58.0));
    }
}
