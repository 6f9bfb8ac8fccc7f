//! AMX tiles for prefill-shaped matmuls, on CPUs that have them (Intel Sapphire Rapids and later):
//! `tdpbf16ps` does 16×16×32 bf16 multiply-adds per instruction and `tdpbusd` 16×16×64 int8 ones (we
//! use 16×16×16: the NVFP4 block), several times what AVX-512 does.
//!
//! Three things stand between a CPU that lists AMX and a tile instruction that runs:
//! - **Permission**, once per process: Linux enables the 8 KiB tile state lazily, and a process must ask
//!   for it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without it the first tile
//!   instruction dies with SIGILL (what llama.cpp's AMX build does on some virtual machines). A refusal
//!   (an old kernel, a hypervisor that hides the state) leaves [`status`] `Refused` and every matmul on
//!   the AVX-512 kernels.
//! - **A tile configuration in every thread** that runs tiles (`ldtilecfg`): it is per-thread state, so
//!   each pool worker loads it before its first tile instruction (and again when a kernel needs another
//!   shape), tracked in a thread-local.
//! - **An assembler**: the tile instructions are written with `asm!` (their intrinsics are not stable
//!   Rust); the compiler never uses tile registers itself, so separate `asm!` blocks may pass tiles.
//!
//! What ran where: the tile kernels are tested against scalar references on odd shapes on a CPU with
//! AMX; elsewhere those tests print why they skip. On every CPU the same kernels run on odd shapes with
//! the tile instructions in software ([`init_emulated`], `emu.rs`, `tests/amx_emulated.rs`), and the
//! fallback (a CPU that lists AMX but whose kernel refuses it) is tested by forcing the refusal
//! (`tests/amx_fallback.rs`).

pub mod bf16;
mod emu;
pub mod int8;

use std::cell::Cell;
use std::sync::OnceLock;

/// Whether the tiles can run in this process, and if not, why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The CPU has AMX-TILE, AMX-BF16 and AMX-INT8, and the kernel granted the tile state.
    Granted,
    /// The CPU (or this build's target) has no AMX.
    NoCpu,
    /// The CPU has AMX, but the kernel refused the tile state (the errno).
    Refused(i32),
    /// The tile instructions run in software (`emu.rs`): a test process's choice, never a server's.
    Emulated,
}

impl Status {
    /// For the startup log and skipped tests.
    pub fn describe(self) -> String {
        match self {
            Status::Granted => "AMX tiles granted".into(),
            Status::NoCpu => "this CPU has no AMX (AMX-TILE, AMX-BF16 and AMX-INT8)".into(),
            Status::Refused(e) => format!("the CPU has AMX but the kernel refused its tile state (errno {e})"),
            Status::Emulated => "AMX tiles emulated in software (a test)".into(),
        }
    }
}

static STATUS: OnceLock<Status> = OnceLock::new();

/// The process's AMX status: decided once, on first use (the permission is asked then).
pub fn status() -> Status {
    *STATUS.get_or_init(|| decide(cpu_has_amx(), request_permission))
}

/// Whether the tile kernels may run.
pub fn available() -> bool {
    matches!(status(), Status::Granted | Status::Emulated)
}

/// Whether the tile instructions run in software.
fn emulated() -> bool {
    status() == Status::Emulated
}

/// Runs this process's tile kernels on the software tiles (`emu.rs`), unless the status is decided
/// already; returns the status in effect. For tests, on machines without AMX: the kernels' own logic on
/// odd shapes, the tile instructions as Intel's reference defines them.
pub fn init_emulated() -> Status {
    *STATUS.get_or_init(|| Status::Emulated)
}

/// Decides the status with a given CPU answer and permission request, unless it is decided already;
/// returns the status in effect. For the fallback test, which pretends a CPU with AMX and a refusal.
pub fn init_with(cpu: bool, request: impl FnOnce() -> Result<(), i32>) -> Status {
    *STATUS.get_or_init(|| decide(cpu, request))
}

fn decide(cpu: bool, request: impl FnOnce() -> Result<(), i32>) -> Status {
    if !cpu {
        return Status::NoCpu;
    }
    match request() {
        Ok(()) => Status::Granted,
        Err(e) => Status::Refused(e),
    }
}

/// CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE, bit 25 AMX-INT8.
fn cpu_has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // Leaf 7 is read only when the CPU reports it.
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && edx & (1 << 25) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Asks Linux for the tile data state, then checks that the permission took.
fn request_permission() -> Result<(), i32> {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these codes reads/writes only the u64 we pass.
        unsafe {
            if libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0 {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(-1));
            }
            let mut mask: u64 = 0;
            if libc::syscall(libc::SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mut mask as *mut u64) != 0 {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(-1));
            }
            if mask & (1 << XFEATURE_XTILEDATA) == 0 {
                return Err(libc::EPERM);
            }
        }
        Ok(())
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        Err(-1)
    }
}

/// A tile configuration (`ldtilecfg`'s 64-byte operand): palette 1, then per tile its bytes per row
/// and its rows.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileConfig(pub [u8; 64]);

impl TileConfig {
    /// Tiles 0.. with the given (rows, bytes per row); the rest unused.
    pub const fn new(tiles: &[(u8, u16)]) -> TileConfig {
        let mut b = [0u8; 64];
        b[0] = 1;
        let mut t = 0;
        while t < tiles.len() {
            let (rows, colsb) = tiles[t];
            b[16 + 2 * t] = (colsb & 0xFF) as u8;
            b[16 + 2 * t + 1] = (colsb >> 8) as u8;
            b[48 + t] = rows;
            t += 1;
        }
        TileConfig(b)
    }
}

thread_local! {
    /// The configuration this thread last loaded (its address identifies it).
    static LOADED: Cell<usize> = const { Cell::new(0) };
}

/// Loads `cfg` into this thread's tile state unless it is the one loaded already.
///
/// # Safety
/// [`available`] must be true.
pub(crate) unsafe fn configure(cfg: &'static TileConfig) {
    let id = cfg as *const TileConfig as usize;
    if LOADED.with(|l| l.get()) != id {
        if emulated() {
            emu::configure(cfg);
        } else {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the caller checked AMX is granted; cfg is a valid 64-byte configuration.
            unsafe {
                std::arch::asm!("ldtilecfg [{c}]", c = in(reg) cfg.0.as_ptr(), options(nostack, readonly));
            }
        }
        LOADED.with(|l| l.set(id));
    }
}

/// The tile instructions, one `asm!` block each, on fixed tile registers (or in software, `emu.rs`, when
/// [`init_emulated`] chose it: one predictable branch per tile instruction).
#[cfg(target_arch = "x86_64")]
macro_rules! tile {
    (zero $t:literal) => {
        if $crate::amx::emulated() {
            $crate::amx::emu::zero($t)
        } else {
            std::arch::asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
        }
    };
    (load $t:literal, $p:expr, $stride:expr) => {
        if $crate::amx::emulated() {
            $crate::amx::emu::load($t, ($p).cast::<u8>(), $stride)
        } else {
            std::arch::asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $p, s = in(reg) $stride,
                options(nostack, readonly))
        }
    };
    (store $t:literal, $p:expr, $stride:expr) => {
        if $crate::amx::emulated() {
            $crate::amx::emu::store($t, ($p).cast::<u8>(), $stride)
        } else {
            std::arch::asm!(concat!("tilestored [{p} + {s}*1], tmm", $t), p = in(reg) $p, s = in(reg) $stride,
                options(nostack))
        }
    };
    (bf16 $c:literal, $a:literal, $b:literal) => {
        if $crate::amx::emulated() {
            $crate::amx::emu::dpbf16ps($c, $a, $b)
        } else {
            std::arch::asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
        }
    };
    (busd $c:literal, $a:literal, $b:literal) => {
        if $crate::amx::emulated() {
            $crate::amx::emu::dpbusd($c, $a, $b)
        } else {
            std::arch::asm!(concat!("tdpbusd tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use tile;

#[cfg(test)]
mod tests {
    use super::*;

    /// The decision: no CPU support means no request at all; a refusal keeps its errno.
    #[test]
    fn the_status_follows_the_cpu_and_the_kernel() {
        assert_eq!(decide(false, || panic!("asked without AMX")), Status::NoCpu);
        assert_eq!(decide(true, || Ok(())), Status::Granted);
        assert_eq!(decide(true, || Err(1)), Status::Refused(1));
        assert!(Status::Refused(1).describe().contains("errno 1"));
        println!("this machine: {}", status().describe());
    }

    /// The configuration's bytes: palette 1, bytes per row little-endian from byte 16, rows from 48.
    #[test]
    fn a_tile_configuration_is_laid_out_as_ldtilecfg_reads_it() {
        let c = TileConfig::new(&[(16, 64), (4, 16)]);
        assert_eq!(c.0[0], 1);
        assert_eq!(&c.0[16..20], &[64, 0, 16, 0]);
        assert_eq!(&c.0[48..50], &[16, 4]);
        assert!(c.0[20..48].iter().all(|&b| b == 0) && c.0[50..].iter().all(|&b| b == 0));
    }
}
