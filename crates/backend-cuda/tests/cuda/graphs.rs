//! CUDA graphs on the emulated device (`osprey_backend_cuda::graph`), below the model: what a recorded
//! step holds, and what ends it.

use std::sync::Arc;

use osprey_backend_cuda::{Arg, DevPtr, DeviceLayer, EmuDevice, Graphed, LaunchConfig};

use crate::common::data;

fn upload(dev: &dyn DeviceLayer, v: &[f32]) -> DevPtr {
    let p = dev.alloc(v.len() * 4).expect("alloc");
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    dev.upload(p, &b).expect("upload");
    p
}

fn download(dev: &dyn DeviceLayer, p: DevPtr, n: usize) -> Vec<f32> {
    let mut b = vec![0u8; n * 4];
    dev.download(p, &mut b).expect("download");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn copy(dev: &dyn DeviceLayer, from: DevPtr, to: DevPtr, n: u32) {
    let cfg = LaunchConfig { grid: [1, 1, 1], block: [64, 1, 1] };
    dev.launch("selftest_copy", cfg, &[Arg::Ptr(from), Arg::Ptr(to), Arg::U32(n), Arg::I32(0)]).expect("launch");
}

/// A recorded step runs nothing until its first host wait, and its replay runs the step's new arguments
/// and uploads: a copy chain x → a → b recorded, then replayed with a new x uploaded and a different
/// length. Another thread's op (the vision tower shares the backend) ends the step's graph there: the
/// recorded ops run first, as issued, and the other thread's op runs eagerly, so a graph holds one
/// step's work alone.
#[test]
fn a_step_runs_at_its_wait_replays_with_new_arguments_and_ends_at_another_threads_op() {
    let g = Arc::new(Graphed::new(Arc::new(EmuDevice::new(1 << 20)), true));
    let n = 37;
    let (x, a, b) = (upload(&*g, &data(1, n)), upload(&*g, &vec![0.0; n]), upload(&*g, &vec![0.0; n]));
    for (step, len) in [(0, 37u32), (1, 20)] {
        let v = data(10 + step, n);
        g.begin(7).expect("begin");
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        g.upload(x, &bytes).expect("a staged upload");
        copy(&*g, x, a, len);
        copy(&*g, a, b, len);
        assert_eq!(g.counts().launched, step, "nothing runs before the step's first wait");
        let got = download(&*g, b, n);
        g.end().expect("end");
        assert_eq!(&got[..len as usize], &v[..len as usize], "step {step}");
    }
    let c = g.counts();
    assert_eq!((c.built, c.launched, c.nodes), (1, 2, 6), "built once, replayed: {c:?}");
    // The two launches' lengths changed; the upload's node did not (its new bytes are in the staging
    // memory it reads, which step 1's answer shows).
    assert_eq!(c.updated, 2, "{c:?}");

    let other = upload(&*g, &vec![0.0; n]);
    g.begin(7).expect("begin");
    copy(&*g, x, a, 37);
    let before = g.counts().launched;
    std::thread::scope(|s| {
        s.spawn(|| copy(&*g, a, other, 37));
    });
    assert_eq!(g.counts().launched, before + 1, "another thread's op launched the step's graph first");
    copy(&*g, a, b, 37);
    assert_eq!(download(&*g, other, n), download(&*g, a, n), "the recorded copy ran before the other thread's");
    g.end().expect("end");
}
