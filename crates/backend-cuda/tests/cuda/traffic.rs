//! Issue 51, item 6: the emulated device meters the global-memory bytes of each launch (the kernels'
//! compiled loads and stores call `emu/traffic.cpp`): distinct 32-byte sectors read and written per
//! launch, and per window between host waits; shared memory and a thread's locals are not global memory.
//! With the arithmetic each kernel declares (`// flops:`), it is what `bench roofline` prices.

use osprey_backend::Flops;
use osprey_backend_cuda::{Arg, Counted, DeviceLayer, EmuDevice, LaunchConfig};

use crate::common::data;

fn upload(dev: &dyn DeviceLayer, v: &[f32]) -> osprey_backend_cuda::DevPtr {
    let p = dev.alloc(v.len() * 4).expect("alloc");
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    dev.upload(p, &b).expect("upload");
    p
}

#[test]
fn each_launch_is_metered_in_distinct_global_bytes_and_a_window_counts_a_byte_once() {
    let dev = Counted::new(std::sync::Arc::new(EmuDevice::new(1 << 20).measuring()));
    let n = 1000;
    let (x, y) = (upload(&dev, &data(1, n)), upload(&dev, &data(2, n)));
    let add = || dev.launch("add_f32", LaunchConfig::elements(n), &[Arg::Ptr(x), Arg::Ptr(y), Arg::U32(n as u32)]);
    add().expect("launch");
    dev.synchronize(dev.record().expect("event")).expect("the launch runs (a host wait: the window closes)");
    let t = dev.traffic().expect("a metering device");
    // `x[i] += y[i]`: x and y read, x written, 4,000 bytes each (125 sectors of 32).
    assert_eq!((t.kernels["add_f32"], t.windows), ((8000, 4000), (8000, 4000)));
    add().expect("launch");
    add().expect("launch");
    let mut back = vec![0u8; 16];
    dev.download(x, &mut back).expect("download (a host wait: the window closes)");
    let t = dev.traffic().expect("a metering device");
    assert_eq!(t.kernels["add_f32"], (24000, 12000), "launch by launch");
    // The second window saw the same sectors twice; the download's own read is a copy, not a launch's.
    assert_eq!(t.windows, (16000, 8000), "a window counts each sector once");
    let c = dev.counts();
    assert_eq!(c.flops["add_f32"], Flops { fp32: 3 * n as u64, ..Flops::default() }, "declared: one add per element");
}

#[test]
fn shared_memory_and_locals_are_not_global_traffic() {
    let dev = EmuDevice::new(1 << 20).measuring();
    let (x, out) = (upload(&dev, &data(3, 256)), upload(&dev, &[0.0; 256]));
    // Each block reverses 64 floats through `__shared__ float s[64]`.
    let cfg = LaunchConfig { grid: [4, 1, 1], block: [64, 1, 1] };
    dev.launch("selftest_reverse", cfg, &[Arg::Ptr(x), Arg::Ptr(out), Arg::I32(1)]).expect("launch");
    dev.synchronize(dev.record().expect("event")).expect("the launch runs");
    assert_eq!(dev.traffic().expect("metering").kernels["selftest_reverse"], (1024, 1024));
    // An unmetered device measures nothing.
    assert!(EmuDevice::new(1 << 20).traffic().is_none());
}

#[test]
fn a_copy_a_memset_and_a_blas_gemm_are_metered_too() {
    let dev = EmuDevice::new(1 << 20).measuring();
    let a = dev.alloc(4096).expect("alloc");
    let b = dev.alloc(4096).expect("alloc");
    dev.zero(a, 4096).expect("memset");
    dev.copy(b, a, 1024).expect("copy");
    // A 4×4×4 bf16 GEMM into f32 C with beta 0: A and B read (32 bytes each), C written (64).
    let g = osprey_backend_cuda::GemmBf16 {
        transa: false,
        transb: false,
        m: 4,
        n: 4,
        k: 4,
        a: (a, 4),
        b: (b, 4),
        c: (a.offset(2048), 4),
        alpha: 1.0,
        beta: 0.0,
    };
    dev.gemm_bf16(g).expect("gemm");
    dev.synchronize(dev.record().expect("event")).expect("the work runs");
    let t = dev.traffic().expect("metering");
    assert_eq!((t.kernels["memset"], t.kernels["memcpy"]), ((0, 4096), (1024, 1024)));
    assert_eq!(t.kernels["cublasGemmEx"], (64, 64));
}
