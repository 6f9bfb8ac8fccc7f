//! Which image of a kernel source the real device loads (issue 51, item 4): the cubin embedded for the
//! card's architecture (`build.rs` compiles one per target card with NVRTC when the build has it), else
//! one compiled at an earlier start (the disk cache, `kernel_cache`), else the embedded PTX, which the
//! driver compiles for any newer card; NVRTC at run time only when none of these exists. So a binary
//! built with NVRTC starts on a machine that has only the NVIDIA driver. Pure, so it is checked without a
//! GPU; `driver/mod.rs` calls it.

use std::borrow::Cow;

/// The oldest target: its PTX is what a card without an embedded cubin JITs.
pub const PTX_ARCH: &str = "compute_80";

/// The image of source `stem` for `arch` (`sm_XY`) from `embedded` images (`(stem, arch, image)`) or the
/// disk `cache` (an image compiled earlier for an architecture), or `None`: NVRTC must compile it.
pub fn choose<'a>(
    stem: &str,
    arch: &str,
    embedded: &'a [(&'a str, &'a str, &'a [u8])],
    cache: impl Fn(&str) -> Option<Vec<u8>>,
) -> Option<Cow<'a, [u8]>> {
    let find = |a: &str| embedded.iter().find(|(s, e, _)| *s == stem && *e == a).map(|(_, _, i)| Cow::Borrowed(*i));
    find(arch).or_else(|| cache(arch).map(Cow::Owned)).or_else(|| find(PTX_ARCH))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cards_cubin_first_then_the_cache_then_the_ptx_then_nvrtc() {
        let table: &[(&str, &str, &[u8])] = &[("norm", "sm_89", b"cubin 89"), ("norm", PTX_ARCH, b"ptx")];
        let none = |_: &str| None;
        assert_eq!(choose("norm", "sm_89", table, none).as_deref(), Some(&b"cubin 89"[..]));
        let cached = |a: &str| (a == "sm_100").then(|| b"cached 100".to_vec());
        assert_eq!(choose("norm", "sm_100", table, cached).as_deref(), Some(&b"cached 100"[..]));
        assert_eq!(choose("norm", "sm_100", table, none).as_deref(), Some(&b"ptx"[..]), "a newer card JITs the PTX");
        assert_eq!(choose("rope", "sm_89", table, none), None, "nothing embedded or cached: NVRTC compiles it");
    }

    /// A binary built with NVRTC (CI's and the GPU kit's builds: `OSPREY_REQUIRE_NVRTC`) starts on any
    /// card from its embedded images alone, with nothing cached and no NVRTC.
    #[test]
    fn a_build_with_nvrtc_needs_no_nvrtc_to_start() {
        let embedded = crate::kernels::embedded();
        if embedded.is_empty() {
            assert!(
                std::env::var_os("OSPREY_REQUIRE_NVRTC").is_none() || !cfg!(feature = "cuda"),
                "OSPREY_REQUIRE_NVRTC is set but the build embedded no kernel image (libnvrtc not found by build.rs)"
            );
            eprintln!("skipped: this build embedded no kernel image (no NVRTC at build time)");
            return;
        }
        for stem in crate::kernels::sources() {
            for arch in ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120", "sm_100", "sm_121"] {
                let image = choose(stem, arch, embedded, |_| None).unwrap_or_else(|| panic!("{stem} on {arch}"));
                assert!(image.starts_with(b"\x7fELF") || image.windows(13).any(|w| w == b".target sm_80"), "{stem}");
            }
        }
        #[cfg(feature = "cuda")]
        for arch in crate::nvrtc::TARGETS {
            assert!(embedded.iter().any(|(_, a, i)| a == arch && i.starts_with(b"\x7fELF")), "a cubin for {arch}");
        }
    }
}
