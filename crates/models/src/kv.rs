//! Paged KV: the K/V rows of every full-attention layer live in fixed-size pages; a sequence holds a page
//! table ([`PageTable`]); attention reads through it; a [`KvPool`] owned by the runner bounds how many
//! pages exist and recycles their buffers.
//!
//! Invariants:
//! - a page holds `page_size` token slots of every KV layer (`[layers][K|V][page_size][kv_heads·head_dim]`);
//!   a table's pages cover tokens `[0, pages·page_size)` in order, and rows `[0, len)` are written;
//! - pages are shared by reference count ([`PageRef`] is an `Arc`): a prefix-cache hit hands the same pages
//!   to a new sequence, never a copy. A shared page is never written: the cache only takes full pages,
//!   and a hit ends on a page boundary, so a sequence writes only into pages it alone holds (a rewind into
//!   a shared page copies it first);
//! - a pooled page's buffer goes back to its pool when the last reference drops (on whichever thread), so
//!   the pool's free count is exact once it has drained its return channel.

use std::ops::Range;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use osprey_backend::{Backend, BackendError, BackendRef, PagedView, Tensor};

use crate::family::KvLayout;

/// Page geometry: slots per page and the KV rows of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    /// Token slots per page.
    pub page_size: usize,
    /// KV layers.
    pub layers: usize,
    /// Floats of one K (or V) row: `kv_heads · head_dim`.
    pub row: usize,
}

impl PageGeometry {
    /// Geometry of a model's KV with pages of `page_size` tokens.
    pub fn new(layout: KvLayout, page_size: usize) -> Self {
        PageGeometry { page_size: page_size.max(1), layers: layout.layers, row: layout.kv_heads * layout.head_dim }
    }

    /// Floats of one page.
    pub fn floats(&self) -> usize {
        self.layers * 2 * self.page_size * self.row
    }

    /// Bytes of one page.
    pub fn bytes(&self) -> usize {
        self.floats() * std::mem::size_of::<f32>()
    }

    /// Offset of the K (`v = false`) or V rows of `layer` inside a page.
    pub fn plane(&self, layer: usize, v: bool) -> usize {
        (layer * 2 + usize::from(v)) * self.page_size * self.row
    }
}

type Returned = (u32, Tensor);

/// One page of KV rows for every KV layer: a backend tensor of `geometry.floats()` elements.
#[derive(Debug)]
pub struct Page {
    id: u32,
    buf: Option<Tensor>,
    /// The pool's return channel (`None` for a page outside any pool).
    home: Option<Sender<Returned>>,
}

impl Page {
    /// The pool's id of this page (`u32::MAX` outside a pool).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes of KV rows the page holds.
    pub fn bytes(&self) -> usize {
        self.data().bytes()
    }

    /// The page's tensor.
    pub fn data(&self) -> &Tensor {
        self.buf.as_ref().expect("a live page has its buffer: this is a bug")
    }

    fn data_mut(&mut self) -> &mut Tensor {
        self.buf.as_mut().expect("a live page has its buffer: this is a bug")
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        if let (Some(home), Some(buf)) = (&self.home, self.buf.take()) {
            // The pool may be gone (shutdown): then the buffer is simply freed.
            let _ = home.send((self.id, buf));
        }
    }
}

/// A shared page.
pub type PageRef = Arc<Page>;

/// A sequence's page table: its KV rows, page by page.
#[derive(Clone, Debug)]
pub struct PageTable {
    geo: PageGeometry,
    pages: Vec<PageRef>,
    /// Pages come from a pool (reserved before a forward); otherwise the table allocates its own.
    pooled: bool,
}

impl PageTable {
    /// An empty table that allocates its own pages as it grows (tests, one-off runs).
    pub fn unpooled(geo: PageGeometry) -> Self {
        PageTable { geo, pages: Vec::new(), pooled: false }
    }

    /// Geometry.
    pub fn geometry(&self) -> PageGeometry {
        self.geo
    }

    /// The pages.
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }

    /// Token slots covered.
    pub fn capacity(&self) -> usize {
        self.pages.len() * self.geo.page_size
    }

    /// Makes room for `tokens` slots (new pages on `b`); a pooled table must have been reserved by its
    /// pool.
    pub(crate) fn grow(&mut self, tokens: usize, b: &dyn Backend) -> crate::Result<()> {
        while self.capacity() < tokens {
            if self.pooled {
                return Err(crate::Error::InvalidInput(format!(
                    "KV pages for {tokens} tokens were not reserved ({} reserved): this is a bug",
                    self.capacity()
                )));
            }
            // A page the backend cannot hold keeps its type: the runner answers `out_of_memory`.
            let buf = b.zeros_f32(&[self.geo.floats()])?;
            self.pages.push(Arc::new(Page { id: u32::MAX, buf: Some(buf), home: None }));
        }
        Ok(())
    }

    /// Keeps the pages covering `[0, tokens)`.
    pub(crate) fn truncate(&mut self, tokens: usize) {
        self.pages.truncate(tokens.div_ceil(self.geo.page_size));
    }

    /// Replaces the table with shared pages (a prefix hit).
    pub(crate) fn share(&mut self, pages: &[&PageRef]) -> Result<(), String> {
        if pages.iter().any(|p| p.data().numel() != self.geo.floats()) {
            return Err("a page of another geometry".into());
        }
        self.pages = pages.iter().map(|p| (*p).clone()).collect();
        Ok(())
    }

    /// Writes rows `rows` of `k`, `v` (`[T, row]` each) into `layer` at token slots `[at, at + n)`.
    pub(crate) fn write(
        &mut self,
        b: &dyn Backend,
        layer: usize,
        at: usize,
        (k, v): (&Tensor, &Tensor),
        rows: Range<usize>,
    ) {
        let (ps, row) = (self.geo.page_size, self.geo.row);
        let n = rows.len();
        let mut i = 0;
        while i < n {
            let (page, slot) = ((at + i) / ps, (at + i) % ps);
            let take = (ps - slot).min(n - i);
            let geo = self.geo;
            let data = writable(&mut self.pages[page]);
            let src = rows.start + i..rows.start + i + take;
            b.write_rows(data, geo.plane(layer, false) + slot * row, k, src.clone());
            b.write_rows(data, geo.plane(layer, true) + slot * row, v, src);
            i += take;
        }
    }

    /// The pages' tensors, in token order (for [`PageTable::view`]).
    pub fn page_tensors(&self) -> Vec<&Tensor> {
        self.pages.iter().map(|p| p.data()).collect()
    }

    /// KV layer `layer` of `pages` (this table's [`PageTable::page_tensors`]) as attention reads it.
    pub fn view<'a>(&self, pages: &'a [&'a Tensor], layer: usize) -> PagedView<'a> {
        PagedView {
            pages,
            page_size: self.geo.page_size,
            k_offset: self.geo.plane(layer, false),
            v_offset: self.geo.plane(layer, true),
        }
    }
}

/// The page's buffer for writing: this holder's alone, or a private copy when the page is shared (a
/// rewind into a cached page; never on the serving path).
fn writable(page: &mut PageRef) -> &mut Tensor {
    if Arc::get_mut(page).is_none() {
        let copy = page.data().clone();
        *page = Arc::new(Page { id: u32::MAX, buf: Some(copy), home: None });
    }
    Arc::get_mut(page).expect("the page was just made private").data_mut()
}

/// Page counts of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages the pool may hold.
    pub total: usize,
    /// Pages not referenced by anyone.
    pub free: usize,
}

/// The pool: at most `total` pages on one backend, buffers recycled through a return channel.
#[derive(Debug)]
pub struct KvPool {
    backend: BackendRef,
    geo: PageGeometry,
    total: usize,
    /// Buffers created so far (at most `total`; created on first need, so RSS grows with use).
    created: usize,
    free: Vec<Returned>,
    back: Receiver<Returned>,
    home: Sender<Returned>,
}

impl KvPool {
    /// A pool of `total` pages of `geo` on `backend` (allocated on first need).
    pub fn new(geo: PageGeometry, total: usize, backend: BackendRef) -> Self {
        let (home, back) = channel();
        KvPool { backend, geo, total, created: 0, free: Vec::new(), back, home }
    }

    /// Geometry.
    pub fn geometry(&self) -> PageGeometry {
        self.geo
    }

    /// Takes back the buffers of pages dropped since the last call.
    fn reclaim(&mut self) {
        while let Ok(r) = self.back.try_recv() {
            self.free.push(r);
        }
    }

    /// Page counts.
    pub fn stats(&mut self) -> PoolStats {
        self.reclaim();
        PoolStats { total: self.total, free: self.total - self.created + self.free.len() }
    }

    /// A page, `None` when every page is referenced, or the backend's refusal to allocate one.
    pub fn alloc(&mut self) -> Result<Option<PageRef>, BackendError> {
        self.reclaim();
        let (id, buf) = match self.free.pop() {
            Some(r) => r,
            None if self.created < self.total => {
                let buf = self.backend.zeros_f32(&[self.geo.floats()])?;
                self.created += 1;
                ((self.created - 1) as u32, buf)
            }
            None => return Ok(None),
        };
        Ok(Some(Arc::new(Page { id, buf: Some(buf), home: Some(self.home.clone()) })))
    }

    /// A table whose pages come from this pool.
    pub fn table(&self) -> PageTable {
        PageTable { geo: self.geo, pages: Vec::new(), pooled: true }
    }

    /// Extends `table` to cover `tokens` slots: [`ReserveError::Full`] (the table unchanged) when the
    /// pool has too few free pages, or the backend's refusal to allocate one.
    pub fn reserve(&mut self, table: &mut PageTable, tokens: usize) -> Result<(), ReserveError> {
        let need = tokens.div_ceil(self.geo.page_size).saturating_sub(table.pages.len());
        if need > self.stats().free {
            return Err(ReserveError::Full(self.stats()));
        }
        for _ in 0..need {
            let p = self.alloc().map_err(ReserveError::Backend)?.expect("counted free pages: this is a bug");
            table.pages.push(p);
        }
        Ok(())
    }
}

/// Why [`KvPool::reserve`] could not.
#[derive(Debug)]
pub enum ReserveError {
    /// Too few free pages (the scheduler plans by them, so this is a bug when it happens).
    Full(PoolStats),
    /// The backend could not allocate a page's memory.
    Backend(BackendError),
}

#[cfg(test)]
mod tests {
    use osprey_backend_cpu::{host, CpuBackend};

    use super::*;

    impl PageTable {
        /// Per page, the K and V planes of `layer` on the host.
        fn planes(&self, layer: usize) -> (Vec<&[f32]>, Vec<&[f32]>) {
            let span = self.geo.page_size * self.geo.row;
            let (k0, v0) = (self.geo.plane(layer, false), self.geo.plane(layer, true));
            self.pages.iter().map(|p| (&host(p.data())[k0..k0 + span], &host(p.data())[v0..v0 + span])).unzip()
        }

        fn write_host(&mut self, layer: usize, at: usize, k: &[f32], v: &[f32]) {
            let b = CpuBackend::default();
            let n = k.len() / self.geo.row;
            let (k, v) =
                (b.upload_f32(k, &[n, self.geo.row]).expect("k"), b.upload_f32(v, &[n, self.geo.row]).expect("v"));
            self.write(&b, layer, at, (&k, &v), 0..n);
        }
    }

    fn geo() -> PageGeometry {
        PageGeometry { page_size: 2, layers: 2, row: 3 }
    }

    #[test]
    fn rows_round_trip_across_pages_and_layers() {
        let mut t = PageTable::unpooled(geo());
        t.grow(5, &CpuBackend::default()).expect("unpooled tables grow");
        assert_eq!(t.pages().len(), 3);
        let k: Vec<f32> = (0..15).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..15).map(|x| -(x as f32)).collect();
        t.write_host(1, 0, &k, &v);
        let (kp, vp) = t.planes(1);
        let flat: Vec<f32> = kp.iter().flat_map(|p| p.iter().copied()).take(15).collect();
        assert_eq!(flat, k);
        assert_eq!(vp[2][..3], [-12.0, -13.0, -14.0]);
        assert!(t.planes(0).0.iter().all(|p| p.iter().all(|&x| x == 0.0)), "layer 0 untouched");
    }

    #[test]
    fn pages_return_to_the_pool_when_the_last_holder_drops_and_shared_pages_are_copied_before_a_write() {
        let mut pool = KvPool::new(geo(), 3, CpuBackend::shared());
        let mut a = pool.table();
        pool.reserve(&mut a, 4).expect("2 pages");
        assert_eq!(pool.stats(), PoolStats { total: 3, free: 1 });
        let mut b = pool.table();
        assert!(pool.reserve(&mut b, 4).is_err(), "2 more pages do not fit");
        assert_eq!(b.pages().len(), 0, "a failed reserve leaves the table unchanged");
        // A hit shares a's pages: no page is used for it.
        let shared: Vec<&PageRef> = a.pages().iter().collect();
        b.share(&shared).expect("same geometry");
        assert_eq!(pool.stats().free, 1);
        let held = a.pages()[0].clone();
        drop(a);
        assert_eq!(pool.stats().free, 1, "b still holds both pages");
        drop(b);
        assert_eq!(pool.stats().free, 2, "the page held here is still referenced");
        drop(held);
        assert_eq!(pool.stats().free, 3);
        // A write into a shared page copies it first; the other holder keeps its rows.
        let mut c = pool.table();
        pool.reserve(&mut c, 2).expect("1 page");
        c.write_host(0, 0, &[1.0; 6], &[1.0; 6]);
        let keep = c.clone();
        c.write_host(0, 1, &[2.0; 3], &[2.0; 3]);
        assert_eq!(keep.planes(0).0[0], &[1.0; 6]);
        assert_eq!(&c.planes(0).0[0][3..], &[2.0; 3]);
    }
}
