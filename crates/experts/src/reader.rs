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

/// Where one read lands: `cap` bytes at `ptr` (4 KiB-aligned, at least the request's aligned window),
/// and the io_uring registered buffer that memory lies in, when the reader registered it.
#[derive(Clone, Copy, Debug)]
pub struct Dest {
    /// Start of the window's memory.
    pub ptr: *mut u8,
    /// Bytes available there.
    pub cap: usize,
    /// Registered buffer index ([`Reader::register`]).
    pub fixed: Option<u16>,
}

/// Reads batches of ranges.
pub trait Reader: Send {
    /// Reads every request; one result per request, in order.
    fn read_batch(&mut self, reqs: &[ReadReq]) -> Vec<std::io::Result<ReadDone>>;

    /// What it is.
    fn kind(&self) -> ReaderKind;

    /// Reads every request's aligned window into its destination, in place; returns per request where
    /// the wanted bytes start in it. This default reads into buffers and copies (test wrappers); the
    /// real readers write straight into the destinations.
    ///
    /// # Safety
    /// Each destination must be valid for writes of `cap` bytes, not read or written by anyone else
    /// until this returns, and hold the request's aligned window (`cap` ≥ the window).
    unsafe fn read_into(&mut self, reqs: &[ReadReq], dests: &[Dest]) -> Vec<std::io::Result<usize>> {
        self.read_batch(reqs)
            .into_iter()
            .zip(dests)
            .map(|(r, d)| {
                r.map(|done| {
                    let n = done.buf.len().min(d.cap);
                    // SAFETY: the caller guarantees `d.ptr` is valid for `d.cap` ≥ `n` bytes, unaliased.
                    unsafe { std::ptr::copy_nonoverlapping(done.buf.as_ref().as_ptr(), d.ptr, n) };
                    done.at
                })
            })
            .collect()
    }

    /// [`Reader::read_into`] at a pace: at most `max_bytes` of windows at the disk at once (a lone larger
    /// window goes alone), and `go()` asked before each submission — it may wait; false submits nothing
    /// more, and the requests not submitted fail. The read-ahead thread's reads (issue 55): its next piece
    /// waits while a demand read is under way, and bounds what a demand read can queue behind. This
    /// default asks once per group that fits `max_bytes` and reads the group with `read_into`; the
    /// io_uring reader keeps the window full instead, submitting the next request as each completes.
    ///
    /// # Safety
    /// As [`Reader::read_into`].
    unsafe fn read_into_paced(
        &mut self,
        reqs: &[ReadReq],
        dests: &[Dest],
        max_bytes: usize,
        go: &mut dyn FnMut() -> bool,
    ) -> Vec<std::io::Result<usize>> {
        let mut out = Vec::with_capacity(reqs.len());
        let mut i = 0;
        while i < reqs.len() {
            let (mut j, mut bytes) = (i, 0);
            while let Some(r) = reqs.get(j) {
                let total = window(r.offset, r.len).2;
                if j > i && bytes + total > max_bytes {
                    break;
                }
                (bytes, j) = (bytes + total, j + 1);
            }
            if !go() {
                break;
            }
            // SAFETY: the caller's contract, for a sub-slice of its requests.
            out.extend(unsafe { self.read_into(&reqs[i..j], &dests[i..j]) });
            i = j;
        }
        out.resize_with(reqs.len(), not_submitted);
        out
    }

    /// Registers `slots` buffers of `stride` bytes from `base` (the expert arena) so reads into them skip
    /// per-I/O page pinning; false when the reader cannot (pread) or the kernel refuses (memlock).
    ///
    /// # Safety
    /// The memory must stay valid for as long as the reader lives.
    unsafe fn register(&mut self, _base: *mut u8, _stride: usize, _slots: usize) -> bool {
        false
    }
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

/// The aligned window covering `[offset, offset + len)`: (file start, offset of the wanted bytes in it,
/// bytes to read).
pub(crate) fn window(offset: u64, len: usize) -> (u64, usize, usize) {
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
    let (_, at, total) = window(r.offset, r.len);
    let mut buf = AlignedBuf::new(total);
    // SAFETY: the buffer is ours, `total` bytes long.
    unsafe { pread_to(f, r, buf.as_mut_ptr())? };
    Ok(ReadDone { buf, at })
}

/// Reads `r`'s aligned window to `dst`; returns where the wanted bytes start.
///
/// # Safety
/// `dst` must be valid for writes of the window's bytes and not accessed by anyone else meanwhile.
unsafe fn pread_to(f: &Opened, r: &ReadReq, dst: *mut u8) -> std::io::Result<usize> {
    let (start, at, total) = window(r.offset, r.len);
    let mut got = 0usize;
    while got < at + r.len {
        // SAFETY: `dst` is valid for `total` bytes; we write at most `total - got` bytes past `got`.
        let n = unsafe {
            libc::pread(f.file.as_raw_fd(), dst.add(got) as *mut libc::c_void, total - got, (start + got as u64) as i64)
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
    Ok(at)
}

/// A destination pointer moved to a reader thread (the caller of `read_into` vouches for it).
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

// SAFETY: the pointer is only written by the one thread it is handed to, while `read_into` waits.
unsafe impl Send for SendPtr {}

impl Reader for PreadReader {
    unsafe fn read_into(&mut self, reqs: &[ReadReq], dests: &[Dest]) -> Vec<std::io::Result<usize>> {
        let files = &self.files;
        let mut out: Vec<Option<std::io::Result<usize>>> = (0..reqs.len()).map(|_| None).collect();
        let work: Vec<(&ReadReq, SendPtr)> = reqs.iter().zip(dests).map(|(r, d)| (r, SendPtr(d.ptr))).collect();
        for (chunk, chunk_out) in work.chunks(self.threads).zip(out.chunks_mut(self.threads)) {
            std::thread::scope(|s| {
                let hs: Vec<_> = chunk
                    .iter()
                    .map(|&(r, p)| {
                        s.spawn(move || {
                            let p = p;
                            // SAFETY: the caller's contract on `dests`; each thread writes its own one.
                            unsafe { pread_to(&files[r.file], r, p.0) }
                        })
                    })
                    .collect();
                for (h, o) in hs.into_iter().zip(chunk_out.iter_mut()) {
                    *o = Some(h.join().unwrap_or_else(|_| Err(std::io::Error::other("reader thread panicked"))));
                }
            });
        }
        out.into_iter().map(|o| o.expect("every request answered")).collect()
    }

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

/// Submits what is queued and waits for at least one completion: the completions as (request index,
/// result), `inflight` counted down. On a ring failure every pending result gets the error and what is in
/// flight is waited for, so no destination is released under the kernel: `None`, and the batch ends.
fn reap(
    ring: &mut io_uring::IoUring,
    inflight: &mut usize,
    results: &mut [Option<std::io::Result<usize>>],
) -> Option<Vec<(usize, i32)>> {
    if let Err(e) = ring.submit_and_wait(1) {
        for r in results.iter_mut().filter(|r| r.is_none()) {
            *r = Some(Err(std::io::Error::new(e.kind(), e.to_string())));
        }
        while *inflight > 0 && ring.submit_and_wait(1).is_ok() {
            *inflight -= ring.completion().count();
        }
        return None;
    }
    let done: Vec<(usize, i32)> = ring.completion().map(|c| (c.user_data() as usize, c.result())).collect();
    *inflight -= done.len();
    Some(done)
}

/// A paced read's request that `go()` stopped before it was submitted.
fn not_submitted() -> std::io::Result<usize> {
    Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "read not submitted: stopped"))
}

/// A completion's result: bytes read, or the errno it carries.
fn completed(res: i32) -> std::io::Result<usize> {
    if res < 0 {
        Err(std::io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

/// io_uring: all reads of a batch submitted together, then reaped.
pub struct UringReader {
    files: Vec<Opened>,
    ring: io_uring::IoUring,
    /// Registered staging buffers (reads into fresh buffers), until the arena is registered instead.
    fixed: Option<Fixed>,
    /// The expert arena's slots are the registered buffers ([`Reader::register`]).
    arena: bool,
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
        Ok(UringReader { files: open_all(paths)?, ring, fixed, arena: false })
    }

    /// Whether reads go through registered buffers.
    pub fn registered(&self) -> bool {
        self.fixed.is_some() || self.arena
    }

    /// Whether the expert arena is registered (reads land in it through fixed buffers).
    pub fn arena_registered(&self) -> bool {
        self.arena
    }
}

impl Reader for UringReader {
    unsafe fn register(&mut self, base: *mut u8, stride: usize, slots: usize) -> bool {
        // The kernel takes at most 16384 registered buffers, addressed by a u16.
        if slots == 0 || slots > 16384 {
            return false;
        }
        // SAFETY: the caller keeps `slots` buffers of `stride` bytes at `base` valid while we live.
        let iovecs: Vec<libc::iovec> = (0..slots)
            .map(|i| libc::iovec { iov_base: unsafe { base.add(i * stride) } as *mut libc::c_void, iov_len: stride })
            .collect();
        let sub = self.ring.submitter();
        if self.fixed.is_some() {
            let _ = sub.unregister_buffers();
        }
        // SAFETY: as above; the registration ends when the ring drops, before the caller's arena.
        match unsafe { sub.register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed = None;
                self.arena = true;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, slots, "registering the expert arena with io_uring refused (memlock limit?); reading into it unregistered");
                if let Some(f) = &self.fixed {
                    let staging: Vec<libc::iovec> = f
                        .slots
                        .iter()
                        .map(|b| libc::iovec { iov_base: b.as_ref().as_ptr() as *mut libc::c_void, iov_len: b.len() })
                        .collect();
                    // SAFETY: the staging buffers live as long as the reader, as at construction.
                    if unsafe { sub.register_buffers(&staging) }.is_err() {
                        self.fixed = None;
                    }
                }
                false
            }
        }
    }

    unsafe fn read_into(&mut self, reqs: &[ReadReq], dests: &[Dest]) -> Vec<std::io::Result<usize>> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.read_into_paced(reqs, dests, usize::MAX, &mut || true) }
    }

    unsafe fn read_into_paced(
        &mut self,
        reqs: &[ReadReq],
        dests: &[Dest],
        max_bytes: usize,
        go: &mut dyn FnMut() -> bool,
    ) -> Vec<std::io::Result<usize>> {
        let mut results: Vec<Option<std::io::Result<usize>>> = (0..reqs.len()).map(|_| None).collect();
        let cap = self.ring.params().sq_entries() as usize;
        let (mut next, mut inflight, mut bytes, mut stopped) = (0, 0, 0usize, false);
        let mut sizes = vec![0usize; reqs.len()];
        while next < reqs.len() || inflight > 0 {
            while !stopped && next < reqs.len() && inflight < cap {
                let (r, d) = (&reqs[next], dests[next]);
                let (start, _, total) = window(r.offset, r.len);
                if total > d.cap {
                    results[next] = Some(Err(std::io::Error::other("read destination smaller than its window")));
                    next += 1;
                    continue;
                }
                if inflight > 0 && bytes + total > max_bytes {
                    break;
                }
                if !go() {
                    stopped = true;
                    break;
                }
                let fd = io_uring::types::Fd(self.files[r.file].file.as_raw_fd());
                let e = match d.fixed.filter(|_| self.arena) {
                    Some(i) => io_uring::opcode::ReadFixed::new(fd, d.ptr, total as u32, i).offset(start).build(),
                    None => io_uring::opcode::Read::new(fd, d.ptr, total as u32).offset(start).build(),
                }
                .user_data(next as u64);
                // SAFETY: the destination outlives the operation (we wait for every completion below).
                if unsafe { self.ring.submission().push(&e) }.is_err() {
                    break;
                }
                (sizes[next], bytes) = (total, bytes + total);
                next += 1;
                inflight += 1;
            }
            if inflight == 0 {
                if next < reqs.len() {
                    let refused = || Err(std::io::Error::other("io_uring submission queue refused a read"));
                    for r in results.iter_mut().filter(|r| r.is_none()) {
                        *r = Some(if stopped { not_submitted() } else { refused() });
                    }
                }
                break;
            }
            let Some(done) = reap(&mut self.ring, &mut inflight, &mut results) else { break };
            for (i, res) in done {
                bytes -= sizes[i];
                results[i] = Some(completed(res));
            }
        }
        results
            .into_iter()
            .zip(reqs)
            .map(|(res, r)| {
                let got = res.unwrap_or_else(|| Err(std::io::Error::other("read not completed")))?;
                let (start, at, total) = window(r.offset, r.len);
                drop_cache(&self.files[r.file], start, total);
                check(got, at, r.len)?;
                Ok(at)
            })
            .collect()
    }

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
            let Some(done) = reap(&mut self.ring, &mut inflight, &mut results) else { break };
            for (i, res) in done {
                if let (Some(slot), Some(f)) = (slot_of[i], self.fixed.as_ref()) {
                    if res > 0 {
                        let n = res as usize;
                        bufs[i].0.as_mut()[..n].copy_from_slice(&f.slots[slot].as_ref()[..n]);
                    }
                    free.push(slot);
                }
                results[i] = Some(completed(res));
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

    /// A paced read (issue 55) gets the bytes `read_into` gets, asks `go()` once per submission (the
    /// io_uring reader once per request, keeping at most the window's bytes at the disk; the default once
    /// per group), and once `go()` says stop submits nothing more: the requests not submitted fail, those
    /// submitted complete.
    #[test]
    fn a_paced_read_asks_before_each_submission_and_stops_when_told() {
        let dir = std::env::temp_dir().join(format!("osprey-reader-paced-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("data.bin");
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 13 % 251) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        let reqs: Vec<ReadReq> = (0..6).map(|i| ReadReq { file: 0, offset: i * 32_768, len: 32_768 }).collect();
        let mut readers: Vec<Box<dyn Reader>> =
            vec![Box::new(PreadReader::new(std::slice::from_ref(&path), 2).expect("pread"))];
        if let Ok(u) = UringReader::new(std::slice::from_ref(&path), 8) {
            readers.push(Box::new(u));
        }
        for mut r in readers {
            let per_request = r.kind() == ReaderKind::IoUring;
            for stop_after in [usize::MAX, 2] {
                let mut bufs: Vec<AlignedBuf> = reqs.iter().map(|_| AlignedBuf::new(32_768)).collect();
                let dests: Vec<Dest> =
                    bufs.iter_mut().map(|b| Dest { ptr: b.as_mut_ptr(), cap: b.len(), fixed: None }).collect();
                let mut asked = 0;
                let mut go = || {
                    asked += 1;
                    asked <= stop_after
                };
                // SAFETY: each buffer is ours and holds its request's window.
                let got = unsafe { r.read_into_paced(&reqs, &dests, 2 * 32_768, &mut go) };
                let read = got.iter().filter(|g| g.is_ok()).count();
                let what = format!("{:?}, stop after {stop_after}", r.kind());
                if stop_after == usize::MAX {
                    assert_eq!(read, reqs.len(), "{what}");
                    assert_eq!(asked, if per_request { 6 } else { 3 }, "{what}: asked per submission");
                } else {
                    assert_eq!(read, if per_request { 2 } else { 4 }, "{what}: what was submitted completes");
                    assert!(
                        got[read..]
                            .iter()
                            .all(|g| g.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::Interrupted)),
                        "{what}"
                    );
                }
                for ((q, g), b) in reqs.iter().zip(&got).zip(&bufs) {
                    if let Ok(at) = g {
                        let o = q.offset as usize;
                        assert_eq!(&b.as_ref()[*at..*at + q.len], &data[o..o + q.len], "{what} {q:?}");
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Reads land in place in an arena's slots, through registered buffers when io_uring takes them.
    #[test]
    fn reads_land_in_place_in_an_arena() {
        let dir = std::env::temp_dir().join(format!("osprey-reader-into-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("data.bin");
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        let reqs = [ReadReq { file: 0, offset: 5, len: 100 }, ReadReq { file: 0, offset: 12_000, len: 9_000 }];
        let mut readers: Vec<Box<dyn Reader>> =
            vec![Box::new(PreadReader::new(std::slice::from_ref(&path), 2).expect("pread"))];
        if let Ok(u) = UringReader::new(std::slice::from_ref(&path), 8) {
            readers.push(Box::new(u));
        }
        for mut r in readers {
            let stride = 4 * ALIGN;
            let mem = osprey_backend_cpu::CpuBackend::shared().alloc_host_arena(2 * stride).expect("arena");
            let arena = crate::arena::Arena::new(mem, stride);
            // SAFETY: the arena outlives the reader (dropped at the end of this iteration, after `r`).
            let registered = unsafe { r.register(arena.base(), stride, arena.slots()) };
            let mut slots = [arena.take().expect("slot"), arena.take().expect("slot")];
            let dests: Vec<Dest> = slots
                .iter_mut()
                .map(|s| Dest { ptr: s.as_mut_ptr(), cap: stride, fixed: registered.then_some(s.index() as u16) })
                .collect();
            // SAFETY: each slot is ours, `stride` bytes, untouched during the read.
            let ats = unsafe { r.read_into(&reqs, &dests) };
            for ((req, at), slot) in reqs.iter().zip(ats).zip(&slots) {
                let at = at.expect("read");
                let o = req.offset as usize;
                assert_eq!(&slot.as_ref()[at..at + req.len], &data[o..o + req.len], "{:?} {req:?}", r.kind());
            }
            let past = [ReadReq { file: 0, offset: 49_995, len: 10 }];
            let d = [dests[0]];
            // SAFETY: as above.
            assert!(unsafe { r.read_into(&past, &d) }[0].is_err(), "{:?}: a short read is an error", r.kind());
            drop(r);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
