//! Batched reads of byte ranges into aligned buffers: io_uring (one submission per batch) with O_DIRECT,
//! or a pool of `pread` threads when io_uring is unavailable or refused (EPERM, ENOSYS in containers).
//! Files are opened with O_DIRECT so our reads do not grow the page cache; filesystems that refuse
//! O_DIRECT (tmpfs) get buffered reads followed by `POSIX_FADV_DONTNEED` for the range.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use crate::buf::{AlignedBuf, ALIGN};

/// One range to read.
#[derive(Clone, Debug)]
pub struct ReadReq {
    /// Index into the reader's files.
    pub file: usize,
    /// Byte offset of the wanted data.
    pub offset: u64,
    /// Bytes wanted.
    pub len: usize,
}

/// A completed read: the buffer and where the wanted bytes start inside it.
#[derive(Debug)]
pub struct ReadDone {
    /// Aligned buffer covering the request.
    pub buf: AlignedBuf,
    /// Offset of the wanted bytes in `buf`.
    pub at: usize,
}

/// Which implementation reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReaderKind {
    /// io_uring, one submission per batch.
    IoUring,
    /// A pool of `pread` threads.
    Pread,
}

/// Reads batches of ranges.
pub trait Reader: Send {
    /// Reads every request; one result per request, in order.
    fn read_batch(&mut self, reqs: &[ReadReq]) -> Vec<std::io::Result<ReadDone>>;
    /// What it is.
    fn kind(&self) -> ReaderKind;
}

#[derive(Debug)]
struct Opened {
    file: File,
    direct: bool,
}

fn open_all(paths: &[PathBuf]) -> std::io::Result<Vec<Opened>> {
    paths
        .iter()
        .map(|p| {
            match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(p) {
                Ok(file) => Ok(Opened { file, direct: true }),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(path = %p.display(), "O_DIRECT refused by the filesystem; using buffered reads with FADV_DONTNEED");
                    Ok(Opened { file: File::open(p)?, direct: false })
                }
                Err(e) => Err(e),
            }
        })
        .collect()
}

/// The aligned window covering `[offset, offset + len)`.
fn window(offset: u64, len: usize) -> (u64, usize, usize) {
    let start = offset / ALIGN as u64 * ALIGN as u64;
    let at = (offset - start) as usize;
    let total = (at + len).div_ceil(ALIGN) * ALIGN;
    (start, at, total)
}

fn drop_cache(f: &Opened, start: u64, len: usize) {
    if !f.direct {
        // SAFETY: plain advisory syscall on an open descriptor.
        unsafe { libc::posix_fadvise(f.file.as_raw_fd(), start as i64, len as i64, libc::POSIX_FADV_DONTNEED) };
    }
}

fn check(got: usize, at: usize, len: usize) -> std::io::Result<()> {
    if got < at + len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("short read: {got} of {} bytes", at + len),
        ));
    }
    Ok(())
}

/// `pread` on a pool of scoped threads (one per request, at most `threads` at once).
#[derive(Debug)]
pub struct PreadReader {
    files: Vec<Opened>,
    threads: usize,
}

impl PreadReader {
    /// Opens the files.
    pub fn new(paths: &[PathBuf], threads: usize) -> std::io::Result<Self> {
        Ok(PreadReader { files: open_all(paths)?, threads: threads.max(1) })
    }
}

fn pread_one(f: &Opened, r: &ReadReq) -> std::io::Result<ReadDone> {
    let (start, at, total) = window(r.offset, r.len);
    let mut buf = AlignedBuf::new(total);
    let mut got = 0usize;
    while got < at + r.len {
        // SAFETY: the buffer is valid for `total` bytes; we write at most `total - got` bytes past `got`.
        let n = unsafe {
            libc::pread(
                f.file.as_raw_fd(),
                buf.as_mut_ptr().add(got) as *mut libc::c_void,
                total - got,
                (start + got as u64) as i64,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    drop_cache(f, start, total);
    check(got, at, r.len)?;
    Ok(ReadDone { buf, at })
}

impl Reader for PreadReader {
    fn read_batch(&mut self, reqs: &[ReadReq]) -> Vec<std::io::Result<ReadDone>> {
        let files = &self.files;
        let mut out: Vec<Option<std::io::Result<ReadDone>>> = (0..reqs.len()).map(|_| None).collect();
        for (chunk_reqs, chunk_out) in reqs.chunks(self.threads).zip(out.chunks_mut(self.threads)) {
            std::thread::scope(|s| {
                let hs: Vec<_> = chunk_reqs.iter().map(|r| s.spawn(move || pread_one(&files[r.file], r))).collect();
                for (h, o) in hs.into_iter().zip(chunk_out.iter_mut()) {
                    *o = Some(h.join().unwrap_or_else(|_| Err(std::io::Error::other("reader thread panicked"))));
                }
            });
        }
        out.into_iter().map(|o| o.expect("every request answered")).collect()
    }

    fn kind(&self) -> ReaderKind {
        ReaderKind::Pread
    }
}

/// Registered (fixed) staging buffers: the kernel pins them once, reads into them skip per-I/O page
/// pinning; completed reads are copied into the expert's own buffer.
struct Fixed {
    slots: Vec<AlignedBuf>,
    size: usize,
}

/// io_uring: all reads of a batch submitted together, then reaped.
pub struct UringReader {
    files: Vec<Opened>,
    ring: io_uring::IoUring,
    fixed: Option<Fixed>,
}

impl std::fmt::Debug for UringReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringReader").field("files", &self.files.len()).finish()
    }
}

impl UringReader {
    /// Sets up a ring; fails when the kernel or the container refuses io_uring. Registers
    /// `min(entries, 16)` staging buffers of 2 MiB when the memlock limit allows (logged once if not).
    pub fn new(paths: &[PathBuf], entries: u32) -> std::io::Result<Self> {
        let ring = io_uring::IoUring::new(entries)?;
        let size = 2 << 20;
        let slots: Vec<AlignedBuf> = (0..entries.min(16)).map(|_| AlignedBuf::new(size)).collect();
        let iovecs: Vec<libc::iovec> = slots
            .iter()
            .map(|b| libc::iovec { iov_base: b.as_ref().as_ptr() as *mut libc::c_void, iov_len: b.len() })
            .collect();
        // SAFETY: the buffers outlive their registration: both are owned by the reader and `ring` is
        // declared before `fixed`, so the ring (and its registration) is dropped first.
        let fixed = match unsafe { ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => Some(Fixed { slots, size }),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring buffer registration refused (memlock limit?); using unregistered buffers");
                None
            }
        };
        Ok(UringReader { files: open_all(paths)?, ring, fixed })
    }

    /// Whether reads go through registered buffers.
    pub fn registered(&self) -> bool {
        self.fixed.is_some()
    }
}

impl Reader for UringReader {
    fn read_batch(&mut self, reqs: &[ReadReq]) -> Vec<std::io::Result<ReadDone>> {
        let mut bufs: Vec<(AlignedBuf, u64, usize, usize)> = reqs
            .iter()
            .map(|r| {
                let (start, at, total) = window(r.offset, r.len);
                (AlignedBuf::new(total), start, at, total)
            })
            .collect();
        let mut results: Vec<Option<std::io::Result<usize>>> = (0..reqs.len()).map(|_| None).collect();
        let cap = self.ring.params().sq_entries() as usize;
        let mut free: Vec<usize> = self.fixed.as_ref().map(|f| (0..f.slots.len()).collect()).unwrap_or_default();
        let mut slot_of: Vec<Option<usize>> = vec![None; reqs.len()];
        let mut next = 0;
        let mut inflight = 0;
        while next < reqs.len() || inflight > 0 {
            while next < reqs.len() && inflight < cap {
                let (buf, start, _, total) = &mut bufs[next];
                let fd = io_uring::types::Fd(self.files[reqs[next].file].file.as_raw_fd());
                let fits = self.fixed.as_ref().is_some_and(|f| *total <= f.size);
                let e = if fits {
                    // Wait for a staging slot rather than reorder.
                    let Some(slot) = free.pop() else { break };
                    slot_of[next] = Some(slot);
                    let f = self.fixed.as_mut().expect("fits implies fixed");
                    io_uring::opcode::ReadFixed::new(fd, f.slots[slot].as_mut_ptr(), *total as u32, slot as u16)
                        .offset(*start)
                        .build()
                        .user_data(next as u64)
                } else {
                    io_uring::opcode::Read::new(fd, buf.as_mut_ptr(), *total as u32)
                        .offset(*start)
                        .build()
                        .user_data(next as u64)
                };
                // SAFETY: the buffer outlives the operation (we wait for every completion below).
                if unsafe { self.ring.submission().push(&e) }.is_err() {
                    if let Some(slot) = slot_of[next].take() {
                        free.push(slot);
                    }
                    break;
                }
                next += 1;
                inflight += 1;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                for r in results.iter_mut().filter(|r| r.is_none()) {
                    *r = Some(Err(std::io::Error::new(e.kind(), e.to_string())));
                }
                // Wait for what is in flight so no buffer is freed under the kernel.
                while inflight > 0 && self.ring.submit_and_wait(1).is_ok() {
                    inflight -= self.ring.completion().count();
                }
                break;
            }
            let done: Vec<(usize, i32)> =
                self.ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
            for (i, res) in done {
                inflight -= 1;
                if let (Some(slot), Some(f)) = (slot_of[i], self.fixed.as_ref()) {
                    if res > 0 {
                        let n = res as usize;
                        bufs[i].0.as_mut()[..n].copy_from_slice(&f.slots[slot].as_ref()[..n]);
                    }
                    free.push(slot);
                }
                results[i] =
                    Some(if res < 0 { Err(std::io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) });
            }
        }
        bufs.into_iter()
            .zip(results)
            .zip(reqs)
            .map(|(((buf, start, at, total), res), r)| {
                let got = res.unwrap_or_else(|| Err(std::io::Error::other("read not completed")))?;
                drop_cache(&self.files[r.file], start, total);
                // A short read can only be the end of the file for O_DIRECT windows; the wanted bytes must be in.
                check(got, at, r.len)?;
                Ok(ReadDone { buf, at })
            })
            .collect()
    }

    fn kind(&self) -> ReaderKind {
        ReaderKind::IoUring
    }
}

/// io_uring when the kernel allows it (logged once otherwise), else the pread pool.
pub fn open_reader(paths: &[PathBuf], prefer: Option<ReaderKind>) -> std::io::Result<Box<dyn Reader>> {
    if prefer != Some(ReaderKind::Pread) {
        match UringReader::new(paths, 64) {
            Ok(r) => return Ok(Box::new(r)),
            Err(e) if prefer == Some(ReaderKind::IoUring) => return Err(e),
            Err(e) => tracing::warn!(error = %e, "io_uring unavailable; reading experts with a pread thread pool"),
        }
    }
    Ok(Box::new(PreadReader::new(paths, 4)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_readers_return_the_exact_bytes_of_unaligned_ranges() {
        let dir = std::env::temp_dir().join(format!("osprey-reader-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("data.bin");
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        let reqs = vec![
            ReadReq { file: 0, offset: 1, len: 10 },
            ReadReq { file: 0, offset: 4095, len: 8193 },
            ReadReq { file: 0, offset: 49_990, len: 10 },
        ];
        let mut readers: Vec<Box<dyn Reader>> =
            vec![Box::new(PreadReader::new(std::slice::from_ref(&path), 2).expect("pread"))];
        if let Ok(u) = UringReader::new(std::slice::from_ref(&path), 8) {
            eprintln!("io_uring available; registered buffers: {}", u.registered());
            readers.push(Box::new(u));
        }
        for mut r in readers {
            let out = r.read_batch(&reqs);
            for (req, res) in reqs.iter().zip(out) {
                let d = res.expect("read");
                let o = req.offset as usize;
                assert_eq!(&d.buf.as_ref()[d.at..d.at + req.len], &data[o..o + req.len], "{:?} {req:?}", r.kind());
                assert_eq!(d.buf.as_ref().as_ptr() as usize % ALIGN, 0);
            }
            let past = r.read_batch(&[ReadReq { file: 0, offset: 49_995, len: 10 }]);
            assert!(past[0].is_err(), "{:?}: reading past the end is a short-read error", r.kind());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
