//! A model directory's small files (configs, the tokenizer, chat templates, the weights' index) read as
//! hostile input, like a request body: a directory can come from anyone's hub repository. Each must be a
//! regular file within a size bound, checked before it is opened: a symlink to `/dev/zero` once read
//! 3.9 GB, and a FIFO hung the load forever (issue 49).

use std::io::Read;
use std::path::Path;

/// Largest config-like file: `config.json`, the processor and quantization configs, the safetensors
/// index (a 1,000-shard index is ~10 MB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Largest `tokenizer.json` (Qwen3.5's is 11 MB) or chat template file.
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// The text of `path`, if it is a regular file (symlinks followed) of at most `max` bytes. A missing
/// file is `NotFound`, as `std::fs::read_to_string` says it; anything else that is not a regular file
/// (a FIFO, a device, a directory) or is larger is `InvalidData`, without reading it.
pub fn read_small(path: &Path, max: u64) -> std::io::Result<String> {
    let meta = std::fs::metadata(path)?;
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    if !meta.is_file() {
        return Err(refuse("not a regular file (a FIFO, device or directory); refused unread".into()));
    }
    if meta.len() > max {
        return Err(refuse(format!("{} bytes, over the limit of {max}", meta.len())));
    }
    let mut text = String::new();
    // The size can change between the check and the read: the read is bounded too.
    std::fs::File::open(path)?.take(max + 1).read_to_string(&mut text)?;
    if text.len() as u64 > max {
        return Err(refuse(format!("grew past the limit of {max} bytes while read")));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO, a link to `/dev/zero` and a file over the bound are refused at once, unread; a missing
    /// file says NotFound; a small one is read. Mutation-checked: without the regular-file check the
    /// FIFO hangs the test.
    #[test]
    fn only_small_regular_files_are_read() {
        let dir = std::env::temp_dir().join(format!("osprey-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let fifo = dir.join("fifo.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success());
        let zero = dir.join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &zero).expect("link");
        let big = dir.join("big.json");
        std::fs::File::create(&big).and_then(|f| f.set_len(MAX_CONFIG_BYTES + 1)).expect("sparse file");
        let mut refused = vec![zero, big];
        if made {
            refused.push(fifo);
        }
        for p in refused {
            let e = read_small(&p, MAX_CONFIG_BYTES).expect_err("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{}: {e}", p.display());
        }
        let missing = read_small(&dir.join("none.json"), MAX_CONFIG_BYTES).expect_err("missing");
        assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
        std::fs::write(dir.join("ok.json"), "{}").expect("write");
        assert_eq!(read_small(&dir.join("ok.json"), MAX_CONFIG_BYTES).expect("read"), "{}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
