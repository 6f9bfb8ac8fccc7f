//! The disk cache of compiled kernels (cubins or PTX) between starts (`driver/mod.rs`). A file is written
//! whole or not at all (a temporary file renamed into place), so a start killed mid-write or two
//! processes compiling at once never leave half a cubin; and each file ends with a checksum of its image,
//! so one that is cut short or damaged anyway is compiled again instead of being loaded.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

/// Where compiled kernels are kept between starts (`OSPREY_KERNEL_CACHE`, else `~/.cache/osprey/kernels`).
pub fn dir() -> PathBuf {
    std::env::var_os("OSPREY_KERNEL_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
        home.join(".cache/osprey/kernels")
    })
}

/// The cache file of source text `source` compiled for `arch`: keyed by the text and the architecture
/// only, so a machine with the driver and no NVRTC finds what another start compiled.
pub fn path(dir: &Path, stem: &str, source: &str, arch: &str) -> PathBuf {
    dir.join(format!("{stem}-{:016x}-{arch}.bin", checksum(source.as_bytes())))
}

fn checksum(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// The image cached at `path`, if the file is whole (its checksum matches).
pub fn read(path: &Path) -> Option<Vec<u8>> {
    let mut bytes = std::fs::read(path).ok()?;
    let at = bytes.len().checked_sub(8)?;
    let sum = u64::from_le_bytes(bytes[at..].try_into().ok()?);
    bytes.truncate(at);
    (checksum(&bytes) == sum).then_some(bytes)
}

/// Caches `image` at `path`, whole or not at all. A cache that cannot be written only costs a compile at
/// the next start, so the error is the caller's to ignore.
pub fn write(path: &Path, image: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let unique = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".tmp-{}-{unique:x}", std::process::id()));
    let mut bytes = image.to_vec();
    bytes.extend_from_slice(&checksum(image).to_le_bytes());
    std::fs::write(&tmp, &bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_file_reads_back_and_a_cut_or_damaged_one_does_not() {
        let dir = std::env::temp_dir().join(format!("osprey-kcache-{}", std::process::id()));
        let p = path(&dir, "norm", "source text", "sm_89");
        assert_ne!(p, path(&dir, "norm", "source text", "sm_90"), "keyed by architecture");
        assert_ne!(p, path(&dir, "norm", "other text", "sm_89"), "keyed by source");
        assert_eq!(read(&p), None, "nothing cached yet");
        let image = b"\x7fELF a cubin".to_vec();
        write(&p, &image).expect("write");
        assert_eq!(read(&p), Some(image.clone()));
        let whole = std::fs::read(&p).expect("file");
        std::fs::write(&p, &whole[..whole.len() - 3]).expect("cut");
        assert_eq!(read(&p), None, "a file cut short is not loaded");
        let mut damaged = whole.clone();
        damaged[2] ^= 1;
        std::fs::write(&p, &damaged).expect("damage");
        assert_eq!(read(&p), None, "a damaged file is not loaded");
        let leftovers = std::fs::read_dir(&dir).expect("dir").filter(|e| e.is_ok()).count();
        assert_eq!(leftovers, 1, "no temporary file is left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
