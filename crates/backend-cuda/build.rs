//! Builds the emulated device: the fiber runtime (`emu/runtime.cpp`) and every kernel source
//! (`kernels/*.cu`) compiled as C++ behind `emu/cuda_emu.hpp`, one translation unit per source, each
//! kernel given a C entry point `osprey_emu_<name>(launch, params)` with `cuLaunchKernel`'s parameter
//! array. Writes `$OUT_DIR/emu_kernels.rs`, the table from kernel name to entry point, and
//! `$OUT_DIR/launches.rs`, one typed Rust function per kernel built from its C signature (`src/launch.rs`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// A kernel of a source: its name, parameters (name and C type), and register budget (the
/// `// budget: N registers` line right above it).
struct Kernel {
    name: String,
    params: Vec<(String, String)>,
    arity: usize,
    budget: u32,
    /// The arithmetic it declares (the `// flops: PATH EXPR[; PATH EXPR]` line above it, or `none`).
    flops: String,
    /// PTX instructions its design names (the `// ptx: a, b` line above it; `none`: no claim).
    ptx: Vec<String>,
}

/// One C parameter (`const float* __restrict__ x`) as (name, type without qualifiers).
fn param(p: &str) -> (String, String) {
    let words: Vec<&str> = p.split_whitespace().filter(|w| !matches!(*w, "__restrict__" | "const")).collect();
    let (name, ty) = words.split_last().expect("a parameter has a name");
    let mut ty = ty.join(" ");
    let name = name.trim_start_matches('*');
    if p.contains('*') && !ty.ends_with('*') {
        ty.push('*');
    }
    (name.to_string(), ty)
}

/// The Rust type a launch passes for a C parameter type, and the [`Arg`] variant that carries it.
fn rust_type(c: &str, kernel: &str) -> (&'static str, &'static str) {
    match c {
        t if t.ends_with('*') => ("DevPtr", "Ptr"),
        "unsigned" => ("u32", "U32"),
        "int" => ("i32", "I32"),
        "float" => ("f32", "F32"),
        other => panic!("kernel {kernel}: parameter type `{other}` has no launch type (add it to build.rs)"),
    }
}

/// `launch::NAME(...)`: the typed constructor of one kernel's [`Call`].
fn launch_fn(stem: &str, k: &Kernel) -> String {
    let params: Vec<String> = k.params.iter().map(|(n, t)| format!("r#{n}: {}", rust_type(t, &k.name).0)).collect();
    let args: Vec<String> = k.params.iter().map(|(n, t)| format!("Arg::{}(r#{n})", rust_type(t, &k.name).1)).collect();
    let sig: Vec<String> = k.params.iter().map(|(n, t)| format!("{t} {n}")).collect();
    format!(
        "/// `{name}({sig})` in `kernels/{stem}.cu`.\n#[allow(clippy::too_many_arguments)]\npub fn {name}({params}) -> Call<{n}> {{\n    Call {{ name: \"{name}\", args: [{args}] }}\n}}\n\n",
        name = k.name,
        sig = sig.join(", "),
        params = params.join(", "),
        n = k.params.len(),
        args = args.join(", "),
    )
}

/// A match arm of `declared_flops`: the kernel's `// flops:` expressions over its scalar parameters and
/// the launch's `blocks` and `threads`, as Rust over `f64` (integer literals made float).
fn flops_arm(k: &Kernel) -> String {
    if k.flops == "none" {
        return String::new();
    }
    let mut vars: Vec<String> = vec!["blocks".into(), "threads".into()];
    let mut binds = String::new();
    for (i, (n, t)) in k.params.iter().enumerate() {
        if !t.ends_with('*') {
            writeln!(binds, "            let r#{n} = num(args, {i});").expect("a string");
            vars.push(n.clone());
        }
    }
    let mut fields = String::new();
    for part in k.flops.split(';') {
        let (path, expr) =
            part.trim().split_once(' ').unwrap_or_else(|| panic!("kernel {}: `// flops: PATH EXPR`", k.name));
        assert!(
            matches!(path, "fp32" | "bf16" | "int8"),
            "kernel {}: flops path `{path}` is fp32, bf16 or int8",
            k.name
        );
        let mut rust = String::new();
        let mut word = String::new();
        for c in expr.chars().chain(std::iter::once(' ')) {
            if c.is_ascii_alphanumeric() || c == '_' {
                word.push(c);
                continue;
            }
            if !word.is_empty() {
                if word.chars().all(|d| d.is_ascii_digit()) {
                    write!(rust, "{word}.0").expect("a string");
                } else {
                    assert!(vars.contains(&word), "kernel {}: `{word}` in its flops is no scalar parameter", k.name);
                    write!(rust, "r#{word}").expect("a string");
                }
                word.clear();
            }
            assert!(" +-*/()".contains(c), "kernel {}: `{c}` in its flops expression", k.name);
            rust.push(c);
        }
        writeln!(fields, "                {path}: ({}) as u64,", rust.trim()).expect("a string");
    }
    format!(
        "        \"{}\" => {{\n{binds}            Flops {{\n{fields}                ..Flops::default()\n            }}\n        }}\n",
        k.name
    )
}

/// The `extern "C" __global__ void NAME(` kernels of a source.
fn kernels_of(src: &str, file: &str) -> Vec<Kernel> {
    const MARK: &str = "extern \"C\" __global__ void ";
    src.match_indices(MARK)
        .map(|(at, _)| {
            let rest = &src[at + MARK.len()..];
            let open = rest.find('(').expect("a kernel's parameter list");
            let close = rest.find(')').expect("a kernel's parameter list");
            let params = rest[open + 1..close].trim();
            let name = rest[..open].trim().to_string();
            // The comment lines right above the kernel.
            let notes: Vec<&str> = src[..at].trim_end().lines().rev().take_while(|l| l.starts_with("//")).collect();
            let note = |key: &str| notes.iter().find_map(|l| l.strip_prefix(key)).map(str::trim);
            let budget = note("// budget: ")
                .and_then(|b| b.strip_suffix(" registers"))
                .and_then(|b| b.parse().ok())
                .unwrap_or_else(|| panic!("{file}: kernel {name} needs a `// budget: N registers` line above it"));
            let flops = note("// flops: ")
                .unwrap_or_else(|| {
                    panic!("{file}: kernel {name} needs a `// flops: PATH EXPR` (or `none`) line above it")
                })
                .to_string();
            let ptx = note("// ptx: ").unwrap_or_else(|| {
                panic!("{file}: kernel {name} needs a `// ptx: INSTR, …` (or `none`) line above it")
            });
            let ptx = ptx.split(',').map(|i| i.trim().to_string()).filter(|i| !i.is_empty() && i != "none").collect();
            let params: Vec<(String, String)> =
                if params.is_empty() { Vec::new() } else { params.split(',').map(param).collect() };
            Kernel { arity: params.len(), params, name, budget, flops, ptx }
        })
        .collect()
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed=emu");
    println!("cargo:rerun-if-changed=kernels");

    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .expect("kernels/")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();

    let mut build = cc::Build::new();
    build.cpp(true).std("c++17").include(root.join("emu")).include(&kernels).warnings(false);
    // The kernels' loads and stores call `emu/traffic.cpp`'s hooks (ThreadSanitizer's instrumentation,
    // without its runtime): the bytes each launch moves, for `bench roofline`.
    build.flag("-fsanitize=thread").flag_if_supported("--param=tsan-instrument-func-entry-exit=0");
    build.flag_if_supported("--param=tsan-distinguish-volatile=0");
    let mut runtime = cc::Build::new();
    runtime.cpp(true).std("c++17").include(root.join("emu")).warnings(false);
    runtime.file(root.join("emu/runtime.cpp")).file(root.join("emu/traffic.cpp"));
    let mut table = String::from("// Generated by build.rs: kernel name → emulated entry point.\n");
    let mut entries = Vec::new();
    let mut sources_rs = Vec::new();
    let mut launches = String::from("// Generated by build.rs: one typed launch per kernel.\n\n");
    let mut flops = String::from(
        "// Generated by build.rs from each kernel's `// flops:` line.\n\n/// The arithmetic kernel `name` declares for one launch.\n#[allow(unused_variables)]\npub(crate) fn declared_flops(name: &str, cfg: &LaunchConfig, args: &[Arg]) -> Flops {\n    let blocks = cfg.grid.iter().map(|&g| f64::from(g)).product::<f64>();\n    let threads = blocks * cfg.block.iter().map(|&b| f64::from(b)).product::<f64>();\n    match name {\n",
    );
    for src in &sources {
        let text = std::fs::read_to_string(src).expect("a kernel source");
        let stem = src.file_stem().and_then(|s| s.to_str()).expect("a UTF-8 name");
        let mut tu = format!("#include \"cuda_emu.hpp\"\n#include \"common.cuh\"\n#include \"{}\"\n", file(src));
        for k in kernels_of(&text, &file(src)) {
            let name = &k.name;
            writeln!(
                tu,
                "extern \"C\" int osprey_emu_{name}(const emu::Launch* l, void** p) {{ return emu::launch({name}, l, p); }}"
            )
            .expect("a string");
            launches.push_str(&launch_fn(stem, &k));
            flops.push_str(&flops_arm(&k));
            entries.push((stem.to_string(), k));
        }
        // A copy inside OUT_DIR, not the checkout's path: clones that share a target directory (CI's and
        // a developer's) reuse this script's output without re-running it, and a path into another clone
        // may be gone.
        let copy = format!("src_{stem}.cu");
        std::fs::write(out.join(&copy), &text).expect("copy a kernel source");
        sources_rs.push(format!("    (\"{stem}\", include_str!(concat!(env!(\"OUT_DIR\"), \"/{copy}\"))),"));
        let path = out.join(format!("emu_{stem}.cpp"));
        std::fs::write(&path, tu).expect("write a translation unit");
        build.file(path);
    }
    build.compile("osprey_cuda_emu");
    // After the kernels: a static library resolves only the symbols of those named before it.
    runtime.compile("osprey_cuda_emu_runtime");

    table.push_str("unsafe extern \"C\" {\n");
    for (_, k) in &entries {
        let name = &k.name;
        writeln!(table, "    fn osprey_emu_{name}(l: *const Launch, p: *mut *mut std::ffi::c_void) -> i32;")
            .expect("a string");
    }
    table.push_str("}\n\n/// Every kernel, with its emulated entry point.\n");
    table.push_str("pub(crate) static EMU_KERNELS: &[(KernelInfo, EmuEntry)] = &[\n");
    for (stem, k) in &entries {
        let (name, arity, budget) = (&k.name, k.arity, k.budget);
        let ptx: Vec<String> = k.ptx.iter().map(|i| format!("{i:?}")).collect();
        let ptx = ptx.join(", ");
        writeln!(
            table,
            "    (KernelInfo {{ source: \"{stem}\", name: \"{name}\", arity: {arity}, registers: {budget}, ptx: &[{ptx}] }}, osprey_emu_{name}),"
        )
        .expect("a string");
    }
    table.push_str("];\n\n/// Every kernel source: (stem, text).\n");
    table.push_str("pub(crate) static SOURCES: &[(&str, &str)] = &[\n");
    table.push_str(&sources_rs.join("\n"));
    table.push_str("\n];\n");
    std::fs::write(out.join("emu_kernels.rs"), table).expect("write the table");
    std::fs::write(out.join("launches.rs"), launches).expect("write the launches");
    flops.push_str("        _ => Flops::default(),\n    }\n}\n");
    std::fs::write(out.join("flops.rs"), flops).expect("write the flops");
}

fn file(p: &Path) -> String {
    p.file_name().and_then(|s| s.to_str()).expect("a UTF-8 name").to_string()
}
