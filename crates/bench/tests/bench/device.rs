//! Issue 51, item 1: `bench forward` on a compute device reports what the prefill and each decode token
//! asked of it (launches, per kernel, host waits, allocations, frees, bytes each way), counted by the
//! device layer; on the CPU there is no device and no such report.

use osprey_bench::synth::{synth, TINY};
use osprey_bench::{bench_forward, ForwardBench};
use osprey_runner::Driver;

#[test]
fn bench_forward_reports_what_each_decode_token_asks_of_the_device() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synth-device");
    let _ = std::fs::remove_dir_all(&dir);
    synth(&dir, TINY, 4, 3).expect("synth");
    let b = ForwardBench { prompt_len: 12, decode_tokens: 3, repeats: 1 };

    let gpu = osprey_backend_cuda::open_emulated(1 << 30);
    // Without the buffer cache every temporary is a device allocation and a free (the mutation check of
    // the assertion below).
    let uncached = std::sync::Arc::new(
        osprey_backend_cuda::CudaBackend::new(
            std::sync::Arc::new(osprey_backend_cuda::EmuDevice::new(1 << 30)),
            osprey_models::backend::Device::CudaEmu,
        )
        .with_buffer_cache(0),
    );
    let model = osprey_models::load_on(&dir, uncached).expect("load on cuda-emu");
    let r = bench_forward(&mut Driver::new(model, 16), b).expect("bench forward");
    let tok = r.device_per_decode_token.expect("a device");
    assert!(tok.allocations > 0.0 && tok.frees > 0.0, "{tok:?}");
    let model = osprey_models::load_on(&dir, gpu).expect("load on cuda-emu");
    let moe_layers = model.info().moe_layers;
    let r = bench_forward(&mut Driver::new(model, 16), b).expect("bench forward");
    let (pre, tok) = (r.device_prefill.expect("a device"), r.device_per_decode_token.expect("a device"));
    for w in [&pre, &tok] {
        assert!(w.launches > 0.0, "{w:?}");
        let by_kernel: f64 = w.kernels.iter().map(|(_, n)| n).sum();
        assert_eq!(by_kernel, w.launches, "every launch is counted under its kernel");
        assert!(w.kernels.windows(2).all(|p| p[0].1 >= p[1].1), "most launched first");
    }
    // Tensors' buffers are recycled (`backend/bufs.rs`): a decode token allocates and frees nothing on
    // the device once the shapes have been seen. With a slot for every expert the router's ids stay on
    // the device (`moe_align` groups them), so the token's one host wait is its sampled id: greedy
    // sampling takes the argmax where the logits are (`sample_rows`), and 4 bytes come back, not the
    // vocabulary's logits.
    assert_eq!((tok.allocations, tok.frees), (0.0, 0.0), "{tok:?}");
    assert_eq!(tok.host_waits, 1.0, "{tok:?}");
    assert_eq!(tok.bytes_from_device, 4.0, "{tok:?}");
    let launched =
        |w: &osprey_bench::DeviceWork, k: &str| w.kernels.iter().find(|(n, _)| n == k).map_or(0.0, |(_, c)| *c);
    assert_eq!(launched(&tok, "sample_rows"), 1.0, "{:?}", tok.kernels);
    assert_eq!(launched(&tok, "moe_align"), moe_layers as f64, "{:?}", tok.kernels);

    // Streamed experts (two slots per layer for eight experts): the layer reads the ids back once (its
    // one routing sync) and uploads each wave's groups in one copy, besides the experts it brings in.
    let (cfg, ck) = (
        osprey_models::ModelConfig::from_dir(&dir).expect("config"),
        osprey_models::Checkpoint::open(&dir).expect("checkpoint"),
    );
    let opts = osprey_models::LoadOptions { expert_slots: Some(2), ..osprey_models::LoadOptions::default() };
    let streamed = osprey_backend_cuda::open_emulated(1 << 30);
    let model = osprey_models::load_with_options(&cfg, &ck, opts, streamed, &mut |_, _| {}).expect("load");
    let r = bench_forward(&mut Driver::new(model, 16), b).expect("bench forward");
    let tok = r.device_per_decode_token.expect("a device");
    assert_eq!(launched(&tok, "moe_align"), 0.0, "{:?}", tok.kernels);
    let waves = launched(&tok, "moe_scatter_rows");
    assert!(waves >= moe_layers as f64, "{tok:?}");
    // Per MoE layer one readback of its ids; per token the logits.
    assert_eq!(tok.host_waits, moe_layers as f64 + 1.0, "{tok:?}");

    let cpu = osprey_models::load_on(&dir, osprey_backend_cpu::CpuBackend::shared()).expect("load on the CPU");
    let r = bench_forward(&mut Driver::new(cpu, 16), b).expect("bench forward");
    assert!(r.device_prefill.is_none() && r.device_per_decode_token.is_none(), "no device on the CPU");
}
