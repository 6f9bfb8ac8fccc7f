//! The arithmetic of a launch, as its kernel declares it: the `// flops: PATH EXPR` line above each
//! kernel in `kernels/*.cu`, an expression over its scalar parameters and the launch's `blocks` and
//! `threads`, compiled by `build.rs` into `declared_flops`. With the bytes the emulated device measures
//! (`emu/traffic.cpp`), it is what the speed model prices (`osprey bench roofline`). A declaration counts
//! the arithmetic the kernel executes, lanes that compute discarded values included (a 16-row tile with
//! one row used does sixteen rows' work).

use osprey_backend::Flops;

use crate::device::{Arg, LaunchConfig};

/// Argument `i` as a number (0 for a pointer or a missing one).
fn num(args: &[Arg], i: usize) -> f64 {
    match args.get(i) {
        Some(Arg::U32(v)) => f64::from(*v),
        Some(Arg::I32(v)) => f64::from(*v),
        Some(Arg::F32(v)) => f64::from(*v),
        _ => 0.0,
    }
}

include!(concat!(env!("OUT_DIR"), "/flops.rs"));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DevPtr;
    use crate::launch;

    #[test]
    fn a_gemv_declares_two_flops_per_weight_and_row_plus_its_decode() {
        let (m, n, k) = (3u32, 64u32, 256u32);
        let call = launch::linear_gemv(DevPtr(0), DevPtr(0), DevPtr(0), 1.0, 3, DevPtr(0), m, n, k);
        let cfg = LaunchConfig { grid: [8, 1, 1], block: [256, 1, 1] };
        let f = declared_flops(call.name, &cfg, &call.args);
        let want = 2 * u64::from(m * n * k) + 2 * u64::from(n * k);
        assert_eq!(f, Flops { fp32: want, ..Flops::default() });
        // Grid-dependent: a tile kernel's every launched thread runs a k-long dot.
        let call = launch::linear_tiled(DevPtr(0), DevPtr(0), DevPtr(0), 1.0, 1, DevPtr(0), 1, 16, 32);
        let cfg = LaunchConfig { grid: [1, 1, 1], block: [16, 16, 1] };
        assert_eq!(declared_flops(call.name, &cfg, &call.args).fp32, 2 * 256 * 32);
        assert_eq!(declared_flops("gather_rows", &cfg, &[]), Flops::default(), "no arithmetic");
    }
}
