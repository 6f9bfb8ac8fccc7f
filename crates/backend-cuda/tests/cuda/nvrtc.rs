//! Every kernel source through NVRTC for every target architecture (feature `cuda`): it compiles, and
//! each kernel stays within the register budget written above it, without spills. CI installs the
//! pinned NVRTC (13.0.x) and sets `OSPREY_REQUIRE_NVRTC=1`, so a missing library fails there; elsewhere
//! the check is skipped with a printed reason.

use osprey_backend_cuda::{kernels, nvrtc};

fn nvrtc_or_skip() -> bool {
    if nvrtc::available() {
        return true;
    }
    assert!(
        std::env::var_os("OSPREY_REQUIRE_NVRTC").is_none(),
        "OSPREY_REQUIRE_NVRTC is set but libnvrtc is not on the library path"
    );
    eprintln!("skipped: libnvrtc not found (see docs/cuda.md: pip install nvidia-cuda-nvrtc==13.0.88)");
    false
}

#[test]
fn every_kernel_compiles_for_every_target_within_its_register_budget() {
    if !nvrtc_or_skip() {
        return;
    }
    let (major, minor) = nvrtc::version().expect("version");
    assert_eq!((major, minor), (13, 0), "pin NVRTC 13.0: a newer one emits PTX the lent GPU's driver refuses");
    let mut report = Vec::new();
    for stem in kernels::sources() {
        for arch in nvrtc::TARGETS {
            let c = nvrtc::compile(stem, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(!c.image.is_empty(), "{stem} {arch}: an empty cubin");
            for k in kernels::all().filter(|k| k.source == stem) {
                let u = c
                    .usage
                    .iter()
                    .find(|u| u.kernel == k.name)
                    .unwrap_or_else(|| panic!("{stem} {arch}: no ptxas report for {}\n{}", k.name, c.log));
                assert!(
                    u.registers <= k.registers,
                    "{} on {arch}: {} registers, budget {}",
                    k.name,
                    u.registers,
                    k.registers
                );
                assert_eq!(u.spill_bytes, 0, "{} on {arch}: spills", k.name);
                report.push(format!("{arch} {}: {} registers", k.name, u.registers));
            }
        }
        // The JIT path of a card newer than the NVRTC: PTX for the oldest target.
        let ptx = nvrtc::compile(stem, "compute_80").unwrap_or_else(|e| panic!("{e}"));
        let ptx = String::from_utf8_lossy(&ptx.image).into_owned();
        assert!(ptx.contains(".target sm_80"), "{stem}: PTX for sm_80");
        for k in kernels::all().filter(|k| k.source == stem) {
            let body = entry_body(&ptx, k.name).unwrap_or_else(|| panic!("{stem}: no .entry {} in its PTX", k.name));
            for want in k.ptx {
                assert!(
                    body.lines()
                        .any(|l| instruction(l).is_some_and(|i| i == *want || i.starts_with(&format!("{want}.")))),
                    "{}: its `// ptx:` line names `{want}`, which its PTX lacks",
                    k.name
                );
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}

/// The PTX of entry `name`: from its `.entry` to the next one.
fn entry_body<'a>(ptx: &'a str, name: &str) -> Option<&'a str> {
    let at = ptx.find(&format!(".entry {name}("))?;
    let rest = &ptx[at + 1..];
    Some(&rest[..rest.find(".entry ").unwrap_or(rest.len())])
}

/// The instruction of a PTX line (`@%p1 ld.global.nc.f32 %f1, [%rd2];` → `ld.global.nc.f32`).
fn instruction(line: &str) -> Option<&str> {
    let l = line.trim_start();
    let l = if l.starts_with('@') { l.split_once(' ')?.1.trim_start() } else { l };
    let word = l.split(|c: char| c.is_whitespace() || c == ';').next()?;
    word.starts_with(|c: char| c.is_ascii_lowercase()).then_some(word)
}

#[test]
fn a_ptx_line_gives_its_instruction() {
    assert_eq!(instruction("\t@%p1 ld.global.nc.v4.u32 {%r1, %r2, %r3, %r4}, [%rd2];"), Some("ld.global.nc.v4.u32"));
    assert_eq!(instruction("\tbar.sync \t0;"), Some("bar.sync"));
    assert_eq!(instruction("// a comment"), None);
    let ptx = ".visible .entry a(\n\tbar.sync 0;\n}\n.visible .entry b(\n\tret;\n}";
    assert!(entry_body(ptx, "a").is_some_and(|b| b.contains("bar.sync") && !b.contains("ret")));
}

#[test]
fn the_report_parser_reads_registers_and_spills() {
    let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'k1' for 'sm_90'\n\
ptxas info    : Function properties for k1\n\
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 380 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'k2' for 'sm_90'\n\
ptxas info    : Function properties for k2\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 12 registers, used 0 barriers, 360 bytes cmem[0]\n";
    let u = nvrtc::usage_of(log);
    assert_eq!(u.len(), 2);
    assert_eq!((u[0].kernel.as_str(), u[0].registers, u[0].spill_bytes), ("k1", 40, 12));
    assert_eq!((u[1].kernel.as_str(), u[1].registers, u[1].spill_bytes), ("k2", 12, 0));
}

/// With the driver layer built, a machine without a driver gets a clear error, never cudarc's panic.
#[test]
fn a_machine_without_a_driver_gets_a_clear_error() {
    if osprey_backend_cuda::driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let e =
        osprey_backend_cuda::open(0, osprey_backend::Precision::Int8).map(|_| ()).expect_err("no driver").to_string();
    assert!(e.contains("cuda:0") && e.contains("libcuda") && e.contains("--device cpu"), "{e}");
}
