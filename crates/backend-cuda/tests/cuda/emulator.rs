//! The emulated device behaves as a GPU does where kernels depend on it: shared memory is one block's,
//! `__syncthreads` orders its writes and reads, shuffles exchange lanes, and the bugs a GPU punishes —
//! a missing barrier, a lane past the warp, a barrier half the block never reaches — show here too.

use osprey_backend_cuda::{Arg, DeviceLayer, EmuDevice, LaunchConfig};

use crate::common::data;

fn upload(dev: &EmuDevice, v: &[f32]) -> osprey_backend_cuda::DevPtr {
    let p = dev.alloc(v.len() * 4).expect("alloc");
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    dev.upload(p, &b).expect("upload");
    p
}

fn download(dev: &EmuDevice, p: osprey_backend_cuda::DevPtr, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    dev.download(p, &mut b).expect("download");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// A launch and the fence after it: a kernel's fault shows at the next fence, as on a GPU (the compute
/// stream runs when the host waits).
fn fenced(
    dev: &EmuDevice,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<(), osprey_backend_cuda::DeviceError> {
    dev.launch(name, cfg, args)?;
    dev.synchronize(dev.record()?)
}

/// Issue 51, item 5: compute is queued and runs when the host waits, and a copy runs as early or as late
/// as its order allows: a copy into memory that queued compute still reads overwrites it first unless
/// ordered after that compute (`copies_after`), and a kernel that reads a copy's destination without
/// waiting for it (`wait_event`) sees the old bytes.
#[test]
fn compute_is_queued_and_a_copy_needs_its_fence_on_either_side() {
    use osprey_backend_cuda::CopyOrder;
    let (a, b) = (data(7, 64), data(8, 64));
    let bytes: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
    let copy = |dev: &EmuDevice, order_after: bool| {
        let (x, out) = (upload(dev, &a), upload(dev, &[0.0; 64]));
        dev.synchronize(dev.record().expect("event")).expect("the uploads land");
        let cfg = LaunchConfig::elements(64);
        dev.launch("selftest_copy", cfg, &[Arg::Ptr(x), Arg::Ptr(out), Arg::U32(64), Arg::I32(0)]).expect("queued");
        if order_after {
            dev.copies_after(dev.record().expect("event")).expect("ordered");
        }
        // SAFETY: `bytes` outlives the copy: the download below drains both streams' work before it.
        let e = unsafe { dev.upload_async(x, bytes.as_ptr(), bytes.len()) }.expect("copy");
        dev.synchronize(e).expect("the copy");
        download(dev, out, 64)
    };
    let early = EmuDevice::new(1 << 20).with_copy_order(CopyOrder::Early);
    assert_eq!(copy(&early, true), a, "ordered after its reader, the copy leaves the read alone");
    assert_eq!(copy(&early, false), b, "unordered, an early copy overwrites what the queued kernel reads");
    // Late: a reader that waits for the copy sees the new bytes, one that does not sees the old.
    let late = EmuDevice::new(1 << 20).with_copy_order(CopyOrder::Late);
    let read = |wait: bool| {
        let (x, out) = (upload(&late, &a), upload(&late, &[0.0; 64]));
        late.synchronize(late.record().expect("event")).expect("the uploads land");
        // SAFETY: as above.
        let e = unsafe { late.upload_async(x, bytes.as_ptr(), bytes.len()) }.expect("copy");
        if wait {
            late.wait_event(e).expect("ordered");
        }
        let cfg = LaunchConfig::elements(64);
        late.launch("selftest_copy", cfg, &[Arg::Ptr(x), Arg::Ptr(out), Arg::U32(64), Arg::I32(0)]).expect("queued");
        let got = download(&late, out, 64);
        late.synchronize(e).expect("drain the copy");
        got
    };
    assert_eq!((read(true), read(false)), (b.clone(), a.clone()));
    // Compute is queued: nothing ran before the host waited.
    let dev = EmuDevice::new(1 << 20);
    let (x, out) = (upload(&dev, &a), upload(&dev, &[0.0; 64]));
    dev.launch("selftest_copy", LaunchConfig::elements(64), &[Arg::Ptr(x), Arg::Ptr(out), Arg::U32(64), Arg::I32(0)])
        .expect("queued");
    let e = dev.record().expect("event");
    assert!(!dev.is_complete(e), "queued work is not complete before a fence");
    dev.synchronize(e).expect("fence");
    assert!(dev.is_complete(e));
}

#[test]
fn a_barrier_orders_shared_memory_and_its_absence_is_caught() {
    let dev = EmuDevice::new(1 << 20);
    let x = data(1, 256);
    let (xp, out) = (upload(&dev, &x), upload(&dev, &[0.0; 256]));
    let cfg = LaunchConfig { grid: [4, 1, 1], block: [64, 1, 1] };
    dev.launch("selftest_reverse", cfg, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(1)]).expect("launch");
    let want: Vec<f32> = x.chunks(64).flat_map(|c| c.iter().rev().copied()).collect();
    assert_eq!(download(&dev, out, 256), want);
    // Without the barrier, a thread may read s[63 − t] before thread 63 − t has written it: the emulator
    // runs threads in a seeded order between barriers, and unwritten shared memory reads as poison.
    dev.launch("selftest_reverse", cfg, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(0)]).expect("launch");
    assert_ne!(download(&dev, out, 256), want, "a missing __syncthreads must change the answer");
}

#[test]
fn shuffles_exchange_lanes_and_a_lane_past_the_warp_fails_the_launch() {
    let dev = EmuDevice::new(1 << 20);
    let x = data(2, 64);
    let (xp, out) = (upload(&dev, &x), upload(&dev, &[0.0; 64]));
    let cfg = LaunchConfig { grid: [1, 1, 1], block: [64, 1, 1] };
    dev.launch("selftest_warp", cfg, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(-1)]).expect("launch");
    let got = download(&dev, out, 64);
    for w in 0..2 {
        let sum: f32 = x[w * 32..(w + 1) * 32].iter().sum();
        for lane in 0..32 {
            assert!((got[w * 32 + lane] - sum).abs() < 1e-5, "warp {w} lane {lane}: {} vs {sum}", got[w * 32 + lane]);
        }
    }
    dev.launch("selftest_warp", cfg, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(5)]).expect("launch");
    let got = download(&dev, out, 64);
    assert!((0..64).all(|i| got[i] == x[(i / 32) * 32 + 5]), "every lane reads lane 5 of its own warp");
    let e = fenced(&dev, "selftest_warp", cfg, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(40)]).expect_err("lane 40");
    assert!(e.to_string().contains("lane"), "{e}");
}

/// Issue 51, item 5: a shuffle's mask is honoured (a lane outside it is an error, as it is undefined on a
/// GPU), and blocks run in a seeded shuffled order, so a kernel that trusts one block to run before
/// another (the planted race) gets the wrong answer here as it may on a card.
#[test]
fn shuffle_masks_are_honoured_and_blocks_run_in_no_order() {
    let dev = EmuDevice::new(1 << 20);
    let x = data(3, 32);
    let (xp, out) = (upload(&dev, &x), upload(&dev, &[0.0; 32]));
    let warp = LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1] };
    dev.launch("selftest_mask", warp, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::U32(u32::MAX)]).expect("a full mask");
    let got = download(&dev, out, 32);
    assert!((0..32).all(|l| got[l] == x[(l + 1) % 32]), "each lane reads the next");
    let e = fenced(&dev, "selftest_mask", warp, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::U32(0xffff)]).expect_err("half");
    assert!(e.to_string().contains("outside its mask"), "{e}");

    let blocks = 64;
    let out = upload(&dev, &vec![0.0; 2 * blocks]);
    let cfg = LaunchConfig { grid: [blocks as u32, 1, 1], block: [32, 1, 1] };
    dev.launch("selftest_blocks", cfg, &[Arg::Ptr(out), Arg::I32(1)]).expect("launch");
    let got = download(&dev, out, 2 * blocks);
    assert!((0..blocks).all(|b| got[b] == (b + 1) as f32), "each block's own write lands");
    let early = (1..blocks).filter(|&b| got[blocks + b] == 0.0).count();
    assert!(early > 0, "every block found its predecessor done: blocks ran in order, hiding the race");
}

#[test]
fn a_barrier_half_the_block_never_reaches_is_a_deadlock_not_a_hang() {
    let dev = EmuDevice::new(1 << 20);
    let out = upload(&dev, &[0.0; 64]);
    let cfg = LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1] };
    // Threads 16..32 exit; CUDA counts exited threads as arrived, so this one completes.
    dev.launch("selftest_diverge", cfg, &[Arg::Ptr(out), Arg::I32(0)]).expect("exited threads count as arrived");
    // A block barrier against a warp barrier: neither can complete. A GPU hangs; the emulator says so.
    let e = fenced(&dev, "selftest_diverge", cfg, &[Arg::Ptr(out), Arg::I32(1)]).expect_err("a deadlock");
    assert!(e.to_string().contains("deadlock") && e.to_string().contains("selftest_diverge"), "{e}");
    // The device still runs the next launch.
    fenced(&dev, "selftest_diverge", cfg, &[Arg::Ptr(out), Arg::I32(0)]).expect("a launch after a fault");
}

#[test]
fn launches_check_their_arguments_and_copies_their_bounds() {
    let dev = EmuDevice::new(1 << 20);
    let p = upload(&dev, &[0.0; 4]);
    let cfg = LaunchConfig::elements(4);
    let e = dev.launch("add_f32", cfg, &[Arg::Ptr(p)]).expect_err("too few arguments");
    assert!(e.to_string().contains("3 parameters"), "{e}");
    assert!(dev.launch("no_such_kernel", cfg, &[]).is_err());
    assert!(dev.upload(p.offset(8), &[0u8; 16]).is_err(), "a copy past its allocation is refused");
    let e = dev.alloc(2 << 20).expect_err("over the cap");
    assert!(matches!(e, osprey_backend_cuda::DeviceError::OutOfMemory { .. }), "{e}");
}

/// Issue 51: a launch over no threads is invalid on a GPU, so the emulated device refuses it too (the
/// backend skips it); an injected allocation failure is the device's fault, which the backend reports
/// through `health` and every later op, without a panic, while running out of memory is not a fault.
#[test]
fn zero_size_launches_are_refused_and_an_injected_fault_is_sticky() {
    let dev = EmuDevice::new(1 << 20);
    let p = upload(&dev, &[0.0; 4]);
    let none = LaunchConfig { grid: [0, 1, 1], block: [256, 1, 1] };
    let e = dev.launch("scale_f32", none, &[Arg::Ptr(p), Arg::F32(2.0), Arg::U32(4)]).expect_err("no threads");
    assert!(e.to_string().contains("no threads"), "{e}");

    use osprey_backend::{Backend, CoreOps, MemoryOps};
    let emu = std::sync::Arc::new(EmuDevice::new(1 << 20));
    let b = osprey_backend_cuda::CudaBackend::new(emu.clone(), osprey_backend::Device::CudaEmu);
    let mut x = b.zeros_f32(&[0, 8]).expect("an empty tensor");
    b.scale(&mut x, 2.0); // a launch over no rows: skipped, not refused
    assert!(b.zeros_f32(&[1 << 20]).is_err() && b.health().is_ok(), "out of memory is not a fault");
    emu.fail_alloc_after(1);
    let e = b.zeros_f32(&[4]).expect_err("the injected failure");
    assert!(e.to_string().contains("injected driver error"), "{e}");
    let fault = b.health().expect_err("sticky");
    assert!(fault.to_string().contains("device fault in allocation"), "{fault}");
    assert!(b.zeros_f32(&[4]).is_err(), "refused after the fault");
}

#[test]
fn every_kernel_has_a_budget_and_its_source() {
    let names: Vec<_> = osprey_backend_cuda::kernels::all().collect();
    assert!(names.len() >= 20, "{} kernels", names.len());
    for k in &names {
        assert!(k.registers >= 16 && k.registers <= 255, "{}: budget {}", k.name, k.registers);
        let src = osprey_backend_cuda::kernels::gpu_source(k.source).expect("its source");
        assert!(src.contains(&format!("void {}(", k.name)) && src.contains("typedef unsigned int uint32_t"));
    }
}

/// Issue 51, item 5: each block has its own shared memory, poisoned when it starts, so a missing
/// `__syncwarp` before lanes read each other's writes, and a block reading shared memory it never wrote
/// (another block's leftovers on a GPU), both give a wrong answer here.
#[test]
fn a_missing_syncwarp_and_a_read_of_unwritten_shared_memory_are_caught() {
    let dev = EmuDevice::new(1 << 20);
    let x = data(9, 32);
    let (xp, out) = (upload(&dev, &x), upload(&dev, &[0.0; 32]));
    let warp = LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1] };
    let want: Vec<f32> = (0..32).map(|l| x[31 - l]).collect();
    dev.launch("selftest_syncwarp", warp, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(1)]).expect("launch");
    assert_eq!(download(&dev, out, 32), want);
    dev.launch("selftest_syncwarp", warp, &[Arg::Ptr(xp), Arg::Ptr(out), Arg::I32(0)]).expect("launch");
    assert!(download(&dev, out, 32).iter().any(|v| v.is_nan()), "without __syncwarp some lane reads poison");

    let blocks = 4;
    let out = upload(&dev, &vec![0.0; 32 * blocks]);
    let cfg = LaunchConfig { grid: [blocks as u32, 1, 1], block: [32, 1, 1] };
    dev.launch("selftest_stale", cfg, &[Arg::Ptr(out), Arg::I32(1)]).expect("launch");
    let got = download(&dev, out, 32 * blocks);
    assert!((0..32 * blocks).all(|i| got[i] == (i / 32 + 1) as f32), "each block reads what it wrote");
    dev.launch("selftest_stale", cfg, &[Arg::Ptr(out), Arg::I32(0)]).expect("launch");
    let got = download(&dev, out, 32 * blocks);
    let written_by_block_0 = |i: usize| got[i] == 1.0;
    assert!((32..32 * blocks).all(|i| got[i].is_nan()), "another block's shared memory is not this block's");
    assert!((0..32).all(written_by_block_0));
}

/// Issue 51, item 5: several blocks are alive at once, their threads interleaved (a GPU runs many blocks
/// concurrently): some block sees another block's write land while it runs.
#[test]
fn several_blocks_are_alive_at_once() {
    let dev = EmuDevice::new(1 << 20);
    let blocks = 16;
    let (flags, seen) = (upload(&dev, &vec![0.0; blocks]), upload(&dev, &vec![0.0; blocks]));
    let cfg = LaunchConfig { grid: [blocks as u32, 1, 1], block: [64, 1, 1] };
    dev.launch("selftest_alive", cfg, &[Arg::Ptr(flags), Arg::Ptr(seen), Arg::U32(blocks as u32)]).expect("launch");
    let seen = download(&dev, seen, blocks);
    assert!(seen.iter().any(|&n| n > 0.0), "no block saw another start and write while it was alive: {seen:?}");
}

fn upload_bytes(dev: &EmuDevice, b: &[u8]) -> osprey_backend_cuda::DevPtr {
    let p = dev.alloc(b.len()).expect("alloc");
    dev.upload(p, b).expect("upload");
    p
}

fn download_bytes(dev: &EmuDevice, p: osprey_backend_cuda::DevPtr, n: usize) -> Vec<u8> {
    let mut b = vec![0u8; n];
    dev.download(p, &mut b).expect("download");
    b
}

/// Issue 52, item 2: the tensor-core primitives (common.cuh) against the PTX ISA's definitions, through
/// `selftest_mma`: an int8 m16n8k16 product against a scalar one, `ldmatrix`'s registers against the
/// matrices' bytes, and `cp.async`'s copies made at their group's wait (zero-filled past the bytes read),
/// not before it — a kernel that reads its staged bytes early reads the block's poisoned shared memory.
#[test]
fn tensor_core_twins_follow_the_ptx_layouts_and_cp_async_lands_at_its_wait() {
    let dev = EmuDevice::new(1 << 20);
    let a = crate::common::bytes(41, 256);
    let b = crate::common::bytes(42, 128);
    let rows = crate::common::bytes(43, 512);
    let (ap, bp, rp) = (upload_bytes(&dev, &a), upload_bytes(&dev, &b), upload_bytes(&dev, &rows));
    let (dp, tp, lp, cp) = (
        upload_bytes(&dev, &[0; 512]),
        upload_bytes(&dev, &[0; 512]),
        upload_bytes(&dev, &[0; 512]),
        upload_bytes(&dev, &[0; 32]),
    );
    let run = |early: i32| {
        let args = [
            Arg::Ptr(ap),
            Arg::Ptr(bp),
            Arg::Ptr(dp),
            Arg::Ptr(tp),
            Arg::Ptr(rp),
            Arg::Ptr(lp),
            Arg::Ptr(cp),
            Arg::I32(early),
        ];
        fenced(&dev, "selftest_mma", LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1] }, &args).expect("selftest_mma");
    };
    run(0);
    let words = |p, n: usize| -> Vec<i32> {
        download_bytes(&dev, p, 4 * n).chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    // D = A · B with B's column j the 16 bytes b[16j..16j+16], all as signed bytes.
    let want: Vec<i32> = (0..16 * 8)
        .map(|o| (0..16).map(|k| i32::from(a[(o / 8) * 16 + k] as i8) * i32::from(b[(o % 8) * 16 + k] as i8)).sum())
        .collect();
    assert_eq!(words(dp, 128), want, "mma.m16n8k16 s8");
    assert_eq!(words(tp, 128), want, "its twin");
    // Lane L's register j: the 4 bytes at (L % 4)·4 of row L / 4 of matrix j (8 rows × 16 bytes each).
    let lm: Vec<u32> = words(lp, 128).iter().map(|&w| w as u32).collect();
    for (i, &got) in lm.iter().enumerate() {
        let (lane, j) = (i / 4, i % 4);
        let at = j * 128 + (lane / 4) * 16 + (lane % 4) * 4;
        assert_eq!(
            got,
            u32::from_le_bytes([rows[at], rows[at + 1], rows[at + 2], rows[at + 3]]),
            "ldmatrix lane {lane} reg {j}"
        );
    }
    let mut copied = rows[..21].to_vec();
    copied.extend([0u8; 11]);
    assert_eq!(download_bytes(&dev, cp, 32), copied, "cp.async: 16 bytes, then 5 and 11 zeros");
    run(1);
    assert_eq!(download_bytes(&dev, cp, 32), vec![0xFF; 32], "read before its wait, a staged copy is not there");
}
