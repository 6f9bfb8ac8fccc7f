//! Issue 51, item 3: a device fault is the engine's failure path, not a panic. A kernel launch that fails
//! on the emulated device (injected, as a GPU reports an illegal address) fails the step's sequences
//! with a 500 naming the kernel, the runner thread stops after answering (its inbox closes: the
//! scheduler and `/health` see it gone), and the device refuses everything after the fault.

use crate::common;

use std::sync::Arc;

use osprey_backend_cuda::{CudaBackend, EmuDevice};
use osprey_models::backend::Device;
use osprey_protocol::runner::{Admission, BatchPlan, PlanItem, RunnerCommand};
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_protocol::ErrorCode;
use osprey_runner::Runner;

fn plan(seq: u64, n: usize) -> BatchPlan {
    let p = Arc::new(PreparedPrompt::text((0..n as u32).map(|i| (i * 37 + 11) % 200).collect()));
    let sampling = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let admit = Admission { prompt: p, sampling, prefix: None, generated: Vec::new() };
    let item = PlanItem {
        seq,
        admit: Some(admit),
        start: 0,
        end: n,
        sample: true,
        snapshot: false,
        budget: usize::MAX,
        span: tracing::Span::none(),
    };
    BatchPlan { items: vec![item], release: Vec::new(), preempt: Vec::new() }
}

fn step(
    tx: &tokio::sync::mpsc::UnboundedSender<RunnerCommand>,
    plan: BatchPlan,
) -> osprey_protocol::runner::StepResult {
    let (reply, rx) = tokio::sync::oneshot::channel();
    tx.send(RunnerCommand::Step { plan, reply }).expect("the runner is up");
    rx.blocking_recv().expect("an answer")
}

#[test]
fn an_injected_kernel_fault_fails_the_step_naming_the_kernel_and_stops_the_runner() {
    let emu = Arc::new(EmuDevice::new(1 << 30));
    let backend = Arc::new(CudaBackend::new(emu.clone(), Device::CudaEmu));
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let model = osprey_models::load_on(&dir, backend.clone()).expect("load on cuda-emu");
    let tx = osprey_runner::spawn(Runner::new(model, None, 16, 16));
    // A healthy step first: it samples.
    let ok = step(&tx, plan(1, 9));
    assert!(ok.failed.is_empty() && ok.sampled.len() == 1, "{:?}", ok.failed);
    // The 5th launch of the next step faults; the ops after it cannot report errors, and must not panic.
    emu.fail_launch_after(5);
    let bad = step(&tx, plan(2, 9));
    assert!(bad.sampled.is_empty(), "nothing computed after a fault is trusted");
    let (seq, e) = &bad.failed[0];
    assert_eq!((*seq, e.code), (2, ErrorCode::EngineError));
    assert!(e.message.contains("device fault in ") && e.message.contains("injected fault"), "{}", e.message);
    // The runner stopped after answering: its inbox closes (waited for, not timed).
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("a runtime");
    rt.block_on(tx.closed());
    // The device refuses everything after the fault, naming it.
    let e = osprey_models::backend::Backend::health(&*backend).expect_err("a sticky fault");
    assert!(e.to_string().contains("device fault in "), "{e}");
    assert!(osprey_models::backend::MemoryOps::zeros_f32(&*backend, &[4]).is_err(), "no allocation after a fault");
}

/// A fault inside a decode step that runs as a CUDA graph (recorded at the first decode step, replayed at
/// the second): the launch that faults is one of the graph's, it surfaces at the step's one host wait
/// (the sampled ids' download), and the step fails with the device fault as an eager step's would.
#[test]
fn a_kernel_fault_inside_a_replayed_decode_graph_fails_the_step() {
    let emu = Arc::new(EmuDevice::new(1 << 30));
    let backend = Arc::new(CudaBackend::new(emu.clone(), Device::CudaEmu).with_graphs(true));
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let model = osprey_models::load_on(&dir, backend.clone()).expect("load on cuda-emu");
    let tx = osprey_runner::spawn(Runner::new(model, None, 16, 16));
    let n = 9;
    assert!(step(&tx, plan(1, n)).failed.is_empty(), "the prefill");
    let decode = |at: usize| {
        let mut p = plan(1, n);
        let item = &mut p.items[0];
        (item.admit, item.start, item.end) = (None, at, at + 1);
        p
    };
    for at in [n, n + 1] {
        let ok = step(&tx, decode(at));
        assert!(ok.failed.is_empty() && ok.sampled.len() == 1, "decode at {at}: {:?}", ok.failed);
    }
    let g = backend.graph_counts();
    assert!(g.launched >= 2 && g.built >= 1, "the decode steps ran as graphs: {g:?}");
    emu.fail_launch_after(7);
    let bad = step(&tx, decode(n + 2));
    let (seq, e) = &bad.failed[0];
    assert_eq!((*seq, e.code), (1, ErrorCode::EngineError));
    assert!(e.message.contains("device fault in ") && e.message.contains("injected fault"), "{}", e.message);
    assert_eq!(backend.graph_counts().built, g.built, "the faulting step replayed the graph");
    let e = osprey_models::backend::Backend::health(&*backend).expect_err("a sticky fault");
    assert!(e.to_string().contains("device fault in "), "{e}");
}
