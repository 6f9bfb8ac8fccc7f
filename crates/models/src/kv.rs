//! Paged KV: the K/V rows of every full-attention layer live in fixed-size pages of one pool tensor per
//! layer (a [`KvStore`]); a sequence holds a page table ([`PageTable`]) of page ids; attention reads the
//! layer's pool through the table's ids (uploaded to the backend as an i32 tensor when the table
//! changes, so a decode step uploads nothing for its KV until it opens a page). A [`KvPool`] owned by the
//! runner bounds how many pages exist.
//!
//! Invariants:
//! - layer `l`'s pool is `[capacity · 2 · page_size, row]`: page `p` holds its K rows at rows
//!   `p·2·page_size ..`, its V rows right after (`page_size` each); a table's pages cover tokens
//!   `[0, pages·page_size)` in order, and rows `[0, len)` are written;
//! - pages are shared by reference count ([`PageRef`] is an `Arc`): a prefix-cache hit hands the same page
//!   ids to a new sequence, never a copy. A shared page is never written: the cache only takes full pages,
//!   and a hit ends on a page boundary, so a sequence writes only into pages it alone holds (a rewind
//!   into a shared page copies it to a fresh page first, before the forward);
//! - a page's id goes back to its store when the last reference drops (on whichever thread: the free
//!   list has its own lock, never held while the layers' is);
//! - the pools grow geometrically (the memory a home server gives the KV is committed as it is used, and
//!   a device pays a copy log₂ times); a growth that does not fit leaves the store as it was.

use std::sync::{Arc, Mutex, MutexGuard};

use osprey_backend::{Backend, BackendError, BackendRef, DType, HostData, PagedView, Tensor};

/// Full-attention KV geometry of a family, for sizing and paging its KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Layers that keep KV (full attention; linear-attention layers keep a fixed-size state instead).
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes of K and V one token occupies over all KV layers (f32 today).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }
}

/// Page geometry: slots per page, the KV rows of one slot, and the element type the rows are kept in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    /// Token slots per page.
    pub page_size: usize,
    /// KV layers.
    pub layers: usize,
    /// Elements of one K (or V) row: `kv_heads · head_dim`.
    pub row: usize,
    /// f32 (the exact path) or bf16 (half the memory; rows are rounded when written).
    pub dtype: DType,
}

impl PageGeometry {
    /// Geometry of a model's f32 KV with pages of `page_size` tokens.
    pub fn new(layout: KvLayout, page_size: usize) -> Self {
        PageGeometry {
            page_size: page_size.max(1),
            layers: layout.layers,
            row: layout.kv_heads * layout.head_dim,
            dtype: DType::F32,
        }
    }

    /// The same geometry with rows kept as `dtype` (f32 or bf16).
    pub fn with_dtype(self, dtype: DType) -> Self {
        PageGeometry { dtype, ..self }
    }

    /// Rows (K and V) of one page in one layer's pool.
    pub fn rows_per_page(&self) -> usize {
        2 * self.page_size
    }

    /// Bytes of one page (every layer).
    pub fn bytes(&self) -> usize {
        let elem = if self.dtype == DType::F32 { 4 } else { 2 };
        self.layers * self.rows_per_page() * self.row * elem
    }
}

/// One layer's pools and their capacity in pages.
#[derive(Debug)]
struct Layers {
    pools: Vec<Tensor>,
    capacity: usize,
}

/// Ids handed out so far and the ids given back.
#[derive(Debug, Default)]
struct Ids {
    created: usize,
    free: Vec<u32>,
}

/// The page pool tensors of every KV layer on one backend, and the ids of their pages.
#[derive(Debug)]
pub struct KvStore {
    geo: PageGeometry,
    /// At most this many pages.
    limit: usize,
    layers: Mutex<Layers>,
    ids: Mutex<Ids>,
}

impl KvStore {
    fn new(geo: PageGeometry, limit: usize) -> Arc<Self> {
        Arc::new(KvStore {
            geo,
            limit,
            layers: Mutex::new(Layers { pools: Vec::new(), capacity: 0 }),
            ids: Mutex::new(Ids::default()),
        })
    }

    fn ids(&self) -> MutexGuard<'_, Ids> {
        self.ids.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn layers(&self) -> MutexGuard<'_, Layers> {
        self.layers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pages not referenced by anyone.
    fn free(&self) -> usize {
        let ids = self.ids();
        self.limit - ids.created + ids.free.len()
    }

    /// Bytes of the pool tensors (what the KV holds on its device).
    pub fn bytes(&self) -> usize {
        self.layers().pools.iter().map(Tensor::bytes).sum()
    }

    /// Grows every layer's pool to hold `pages` pages (doubling, up to the limit); all or nothing.
    fn reserve_capacity(&self, pages: usize, b: &dyn Backend) -> Result<(), BackendError> {
        let mut l = self.layers();
        if l.capacity >= pages {
            return Ok(());
        }
        let cap = pages.max(l.capacity * 2).max(4).min(self.limit).max(pages);
        let geo = self.geo;
        let mut grown = Vec::with_capacity(geo.layers);
        for old in l.pools.iter().map(Some).chain(std::iter::repeat(None)).take(geo.layers) {
            let mut t = b.zeros(geo.dtype, &[cap * geo.rows_per_page(), geo.row])?;
            if let Some(old) = old {
                b.write_rows(&mut t, 0, old, 0..old.rows());
            }
            grown.push(t);
        }
        *l = Layers { pools: grown, capacity: cap };
        Ok(())
    }

    /// A page, `None` when every page is referenced, or the backend's refusal to grow the pools.
    fn alloc(self: &Arc<Self>, b: &dyn Backend) -> Result<Option<PageRef>, BackendError> {
        let id = {
            let mut ids = self.ids();
            match ids.free.pop() {
                Some(id) => id,
                None if ids.created < self.limit => {
                    ids.created += 1;
                    (ids.created - 1) as u32
                }
                None => return Ok(None),
            }
        };
        if let Err(e) = self.reserve_capacity(id as usize + 1, b) {
            self.ids().free.push(id);
            return Err(e);
        }
        Ok(Some(Arc::new(Page { id, store: self.clone() })))
    }
}

/// One page of KV rows for every KV layer: an id into its store's pools.
#[derive(Debug)]
pub struct Page {
    id: u32,
    store: Arc<KvStore>,
}

impl Page {
    /// The store's id of this page.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Bytes of KV rows the page holds.
    pub fn bytes(&self) -> usize {
        self.store.geo.bytes()
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        self.store.ids().free.push(self.id);
    }
}

/// A shared page.
pub type PageRef = Arc<Page>;

/// A sequence's page table: its KV rows, page by page.
#[derive(Clone, Debug)]
pub struct PageTable {
    geo: PageGeometry,
    /// The store the pages come from (an unpooled table makes its own on first growth).
    store: Option<Arc<KvStore>>,
    pages: Vec<PageRef>,
    /// Pages come from a pool (reserved before a forward); otherwise the table allocates its own.
    pooled: bool,
    /// The page ids as attention reads them (i32 on the backend), made again when the pages change.
    ids: Option<Tensor>,
}

impl PageTable {
    /// An empty table that allocates its own pages as it grows (tests, one-off runs).
    pub fn unpooled(geo: PageGeometry) -> Self {
        PageTable { geo, store: None, pages: Vec::new(), pooled: false, ids: None }
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

    fn push(&mut self, p: PageRef) {
        self.pages.push(p);
        self.ids = None;
    }

    /// Before a forward that writes slots `[from, tokens)`: makes room for them (new pages on `b` for
    /// an unpooled table; a pooled one must have been reserved by its pool), gives the table a private
    /// copy of any shared page among them, and uploads the page ids if they changed.
    pub(crate) fn grow(&mut self, from: usize, tokens: usize, b: &dyn Backend) -> crate::Result<()> {
        while self.capacity() < tokens {
            if self.pooled {
                return Err(crate::Error::Engine(format!(
                    "KV pages for {tokens} tokens were not reserved ({} reserved): this is a bug",
                    self.capacity()
                )));
            }
            let store = match &self.store {
                Some(s) => s.clone(),
                None => {
                    let s = KvStore::new(self.geo, u32::MAX as usize);
                    self.store = Some(s.clone());
                    s
                }
            };
            // A page the backend cannot hold keeps its type: the runner answers `out_of_memory`.
            let p = store.alloc(b)?.expect("an unpooled store is unbounded: this is a bug");
            self.push(p);
        }
        let ps = self.geo.page_size;
        for i in from / ps..tokens.div_ceil(ps) {
            if Arc::strong_count(&self.pages[i]) > 1 {
                self.make_private(i, b)?;
            }
        }
        self.upload_ids(b)
    }

    /// Uploads the page ids when they changed since the last upload.
    fn upload_ids(&mut self, b: &dyn Backend) -> crate::Result<()> {
        if self.ids.is_none() && !self.pages.is_empty() {
            let ids: Vec<i32> = self.pages.iter().map(|p| p.id as i32).collect();
            self.ids = Some(b.upload(HostData::I32(&ids), &[ids.len()])?);
        }
        Ok(())
    }

    /// Replaces shared page `i` with a private copy (a rewind into a cached page; never on the serving
    /// path, where writes start on a page the sequence alone holds).
    fn make_private(&mut self, i: usize, b: &dyn Backend) -> crate::Result<()> {
        let store = self.pages[i].store.clone();
        let fresh = match store.alloc(b)? {
            Some(p) => p,
            None => return Err(crate::Error::Engine("no free KV page to copy a shared page into".into())),
        };
        let (from, to, n) = (self.pages[i].id as usize, fresh.id as usize, self.geo.rows_per_page());
        let mut l = store.layers();
        for pool in l.pools.iter_mut() {
            let rows: Vec<usize> = (from * n..(from + 1) * n).collect();
            let copy = b.gather_rows(pool, &rows)?;
            b.write_rows(pool, to * n * self.geo.row, &copy, 0..n);
        }
        drop(l);
        self.pages[i] = fresh;
        self.ids = None;
        Ok(())
    }

    /// Keeps the pages covering `[0, tokens)`.
    pub(crate) fn truncate(&mut self, tokens: usize) {
        let keep = tokens.div_ceil(self.geo.page_size);
        if keep < self.pages.len() {
            self.pages.truncate(keep);
            self.ids = None;
        }
    }

    /// Replaces the table with shared pages (a prefix hit).
    pub(crate) fn share(&mut self, pages: &[&PageRef]) -> Result<(), String> {
        if pages.iter().any(|p| p.store.geo != self.geo) {
            return Err("a page of another geometry".into());
        }
        if let Some(p) = pages.first() {
            if pages.iter().any(|q| !Arc::ptr_eq(&q.store, &p.store)) {
                return Err("pages of two stores".into());
            }
            self.store = Some(p.store.clone());
        }
        self.pages = pages.iter().map(|p| (*p).clone()).collect();
        self.ids = None;
        Ok(())
    }

    /// The pool rows of the K rows of token slots `[at, at + n)` (each V row `page_size` rows further),
    /// where a forward writes them (private pages, made so by [`PageTable::grow`]).
    pub(crate) fn k_rows(&self, at: usize, n: usize) -> impl Iterator<Item = usize> + '_ {
        let (ps, per) = (self.geo.page_size, self.geo.rows_per_page());
        (at..at + n).map(move |t| {
            let page = &self.pages[t / ps];
            debug_assert_eq!(Arc::strong_count(page), 1, "a write into a shared page: this is a bug");
            page.id as usize * per + t % ps
        })
    }

    /// The page ids as attention reads them (uploaded by [`PageTable::grow`]).
    pub(crate) fn ids_on_backend(&self) -> &Tensor {
        self.ids.as_ref().expect("page ids are uploaded before a forward: this is a bug")
    }

    /// Runs `f` over KV layer `layer` as attention reads it (after [`PageTable::grow`]).
    pub fn attend<R>(&self, layer: usize, f: impl FnOnce(PagedView<'_>) -> R) -> R {
        let store = self.store.as_ref().expect("a table attended has pages: this is a bug");
        let l = store.layers();
        f(PagedView { pool: &l.pools[layer], table: self.ids_on_backend(), page_size: self.geo.page_size })
    }
}

/// Runs `f` once for each store among `tables` (the sequences of a served batch share their pool's;
/// an unpooled table has its own) with KV layer `layer`'s pool and the indices of the tables it holds,
/// in order: a step writes and attends each store's sequences together.
pub(crate) fn by_store<R>(
    tables: &[&mut PageTable],
    layer: usize,
    mut f: impl FnMut(&mut Tensor, &[usize]) -> crate::Result<R>,
) -> crate::Result<Vec<R>> {
    let store = |i: usize| tables[i].store.as_ref().expect("a table written has pages: this is a bug");
    let mut left: Vec<usize> = (0..tables.len()).collect();
    let mut out = Vec::new();
    while let Some(&first) = left.first() {
        let (members, rest): (Vec<usize>, Vec<usize>) =
            left.iter().partition(|&&i| Arc::ptr_eq(store(i), store(first)));
        let mut l = store(first).layers();
        out.push(f(&mut l.pools[layer], &members)?);
        left = rest;
    }
    Ok(out)
}

/// Page counts of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pages the pool may hold.
    pub total: usize,
    /// Pages not referenced by anyone.
    pub free: usize,
}

/// The pool: at most `total` pages on one backend.
#[derive(Debug)]
pub struct KvPool {
    store: Arc<KvStore>,
    backend: BackendRef,
    total: usize,
}

impl KvPool {
    /// A pool of `total` pages of `geo` on `backend` (its memory committed as pages are first used).
    pub fn new(geo: PageGeometry, total: usize, backend: BackendRef) -> Self {
        KvPool { store: KvStore::new(geo, total), backend, total }
    }

    /// Geometry.
    pub fn geometry(&self) -> PageGeometry {
        self.store.geo
    }

    /// Page counts.
    pub fn stats(&mut self) -> PoolStats {
        PoolStats { total: self.total, free: self.store.free() }
    }

    /// Bytes of the pool tensors.
    pub fn bytes(&self) -> usize {
        self.store.bytes()
    }

    /// A page, `None` when every page is referenced, or the backend's refusal to allocate one.
    pub fn alloc(&mut self) -> Result<Option<PageRef>, BackendError> {
        self.store.alloc(self.backend.as_ref())
    }

    /// A table whose pages come from this pool.
    pub fn table(&self) -> PageTable {
        PageTable { geo: self.store.geo, store: Some(self.store.clone()), pages: Vec::new(), pooled: true, ids: None }
    }

    /// Extends `table` to cover `tokens` slots: [`ReserveError::Full`] (the table unchanged) when the
    /// pool has too few free pages, or the backend's refusal to allocate one.
    pub fn reserve(&mut self, table: &mut PageTable, tokens: usize) -> Result<(), ReserveError> {
        let need = tokens.div_ceil(self.store.geo.page_size).saturating_sub(table.pages.len());
        if need > self.stats().free {
            return Err(ReserveError::Full(self.stats()));
        }
        for _ in 0..need {
            let p = self.alloc().map_err(ReserveError::Backend)?.expect("counted free pages: this is a bug");
            table.push(p);
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
    use osprey_backend::HostVec;
    use osprey_backend_cpu::CpuBackend;
    use proptest::prelude::*;

    use super::*;

    impl PageTable {
        /// The K and V rows of tokens `[0, n)` of `layer`, read through the uploaded page table the way
        /// attention reads them (widened from bf16).
        fn read(&self, b: &dyn Backend, layer: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
            let row = self.geo.row;
            self.attend(layer, |view| {
                let pool = match b.download(view.pool).expect("pool") {
                    HostVec::F32(v) => v,
                    HostVec::Bf16(v) => v.iter().map(|&x| f32::from_bits(u32::from(x) << 16)).collect(),
                    _ => panic!("a KV pool is f32 or bf16"),
                };
                let ids = match b.download(view.table).expect("table") {
                    HostVec::I32(v) => v,
                    _ => panic!("a page table is i32"),
                };
                let (mut k, mut v) = (Vec::new(), Vec::new());
                for t in 0..n {
                    let at = view.k_row(ids[t / view.page_size] as usize, t % view.page_size) * row;
                    k.extend_from_slice(&pool[at..at + row]);
                    v.extend_from_slice(&pool[at + view.page_size * row..at + (view.page_size + 1) * row]);
                }
                (k, v)
            })
        }

        /// Writes rows `rows` of `k`, `v` into `layer` at token slots `[at, at + n)`, row by row at
        /// [`PageTable::k_rows`].
        fn write(
            &mut self,
            b: &dyn Backend,
            layer: usize,
            at: usize,
            (k, v): (&Tensor, &Tensor),
            rows: std::ops::Range<usize>,
        ) {
            let (row, ps) = (self.geo.row, self.geo.page_size);
            let dst: Vec<usize> = self.k_rows(at, rows.len()).collect();
            let store = self.store.clone().expect("grown");
            let mut l = store.layers();
            let pool = &mut l.pools[layer];
            for (src, d) in rows.zip(dst) {
                b.write_rows(pool, d * row, k, src..src + 1);
                b.write_rows(pool, (d + ps) * row, v, src..src + 1);
            }
        }

        /// Writes `k`, `v` (`n` rows) into `layer` at slot `at`, as a forward does: grow, then write.
        fn write_host(&mut self, b: &dyn Backend, layer: usize, at: usize, k: &[f32], v: &[f32]) -> crate::Result<()> {
            let n = k.len() / self.geo.row;
            self.grow(at, at + n, b)?;
            let (k, v) = (b.upload_f32(k, &[n, self.geo.row])?, b.upload_f32(v, &[n, self.geo.row])?);
            self.write(b, layer, at, (&k, &v), 0..n);
            Ok(())
        }

        fn ids(&self) -> Vec<u32> {
            self.pages.iter().map(|p| p.id()).collect()
        }
    }

    fn geo() -> PageGeometry {
        PageGeometry { page_size: 2, layers: 2, row: 3, dtype: DType::F32 }
    }

    #[test]
    fn rows_round_trip_across_pages_and_layers() {
        let b = CpuBackend::default();
        let mut t = PageTable::unpooled(geo());
        let k: Vec<f32> = (0..15).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..15).map(|x| -(x as f32)).collect();
        t.write_host(&b, 1, 0, &k, &v).expect("unpooled tables grow");
        assert_eq!(t.pages().len(), 3);
        assert_eq!(t.read(&b, 1, 5), (k, v));
        assert!(t.read(&b, 0, 5).0.iter().all(|&x| x == 0.0), "layer 0 untouched");
        // One pool tensor per layer, grown for the pages in use.
        let store = t.store.as_ref().expect("a store");
        assert_eq!(store.layers().pools.len(), 2);
        assert!(store.layers().pools.iter().all(|p| p.shape() == [4 * 2 * 2, 3]));
    }

    #[test]
    fn pages_return_to_the_pool_when_the_last_holder_drops_and_shared_pages_are_copied_before_a_write() {
        let b = CpuBackend::shared();
        let mut pool = KvPool::new(geo(), 3, b.clone());
        let mut a = pool.table();
        pool.reserve(&mut a, 4).expect("2 pages");
        assert_eq!(pool.stats(), PoolStats { total: 3, free: 1 });
        let mut c = pool.table();
        assert!(pool.reserve(&mut c, 4).is_err(), "2 more pages do not fit");
        assert_eq!(c.pages().len(), 0, "a failed reserve leaves the table unchanged");
        // A hit shares a's pages: no page is used for it.
        let shared: Vec<&PageRef> = a.pages().iter().collect();
        c.share(&shared).expect("same geometry");
        assert_eq!(pool.stats().free, 1);
        let held = a.pages()[0].clone();
        drop(a);
        assert_eq!(pool.stats().free, 1, "c still holds both pages");
        drop(c);
        assert_eq!(pool.stats().free, 2, "the page held here is still referenced");
        drop(held);
        assert_eq!(pool.stats().free, 3);
        // A write into a shared page copies it to a fresh page first; the other holder keeps its rows.
        let mut d = pool.table();
        pool.reserve(&mut d, 2).expect("1 page");
        d.write_host(b.as_ref(), 0, 0, &[1.0; 6], &[1.0; 6]).expect("write");
        let keep = d.clone();
        d.write_host(b.as_ref(), 0, 1, &[2.0; 3], &[2.0; 3]).expect("write");
        assert_ne!(keep.ids(), d.ids(), "the written page was copied");
        assert_eq!(keep.read(b.as_ref(), 0, 2).0, [1.0; 6]);
        assert_eq!(d.read(b.as_ref(), 0, 2).0, [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]);
    }

    #[test]
    fn a_bf16_pool_takes_half_the_memory_and_rounds_rows_once() {
        let b = CpuBackend::default();
        let (mut f, mut h) = (PageTable::unpooled(geo()), PageTable::unpooled(geo().with_dtype(DType::BF16)));
        let k = [1.0, 1.0 + 1.0 / 256.0, 1.234_567, -2.0e-3, 65_504.0, 0.1];
        for t in [&mut f, &mut h] {
            t.write_host(&b, 0, 0, &k, &k).expect("write");
        }
        let bytes = |t: &PageTable| t.store.as_ref().expect("store").bytes();
        assert_eq!(bytes(&h) * 2, bytes(&f));
        assert_eq!(geo().with_dtype(DType::BF16).bytes() * 2, geo().bytes());
        assert_eq!(f.read(&b, 0, 2).0, k, "f32 keeps the rows exactly");
        let rounded: Vec<f32> =
            k.iter().map(|&x| f32::from_bits(u32::from(osprey_kernels::bf16::round(x)) << 16)).collect();
        assert_eq!(h.read(&b, 0, 2).0, rounded);
        assert_ne!(rounded, k, "the sample has values bf16 cannot hold");
    }

    /// What one step of the property test does to the tables.
    #[derive(Clone, Debug)]
    enum Step {
        /// A new table with `tokens` written rows.
        Fill { tokens: usize, value: u8 },
        /// Table `i` writes `n` rows more at its end.
        Append { i: usize, n: usize, value: u8 },
        /// A new table shares the first `pages` full pages of table `i` (a prefix hit).
        Share { i: usize, pages: usize },
        /// Table `i` is cut to `tokens` (a rewind), then rewrites its last token.
        Rewind { i: usize, tokens: usize, value: u8 },
        /// Table `i` ends.
        Drop { i: usize },
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let step = prop_oneof![
            (1usize..9, any::<u8>()).prop_map(|(tokens, value)| Step::Fill { tokens, value }),
            (0usize..4, 1usize..5, any::<u8>()).prop_map(|(i, n, value)| Step::Append { i, n, value }),
            (0usize..4, 1usize..4).prop_map(|(i, pages)| Step::Share { i, pages }),
            (0usize..4, 1usize..8, any::<u8>()).prop_map(|(i, tokens, value)| Step::Rewind { i, tokens, value }),
            (0usize..4).prop_map(|i| Step::Drop { i }),
        ];
        prop::collection::vec(step, 1..40)
    }

    proptest! {
        /// The page pool against a model of it: every table reads back the rows written through it (a
        /// write never reaches a page another table holds), the free count is the pool less the pages
        /// some table holds, a reserve that does not fit changes nothing, and every page comes back.
        #[test]
        fn tables_read_their_own_rows_and_pages_are_counted_exactly(steps in steps()) {
            const TOTAL: usize = 10;
            let b = CpuBackend::shared();
            let g = PageGeometry { page_size: 2, layers: 1, row: 1, dtype: DType::F32 };
            let mut pool = KvPool::new(g, TOTAL, b.clone());
            // Each live table with the K value it should read at each token.
            let mut live: Vec<(PageTable, Vec<f32>)> = Vec::new();
            // Writes `vals` at the end of table `i`, when its pages fit; false when they do not.
            fn append(pool: &mut KvPool, b: &dyn Backend, t: &mut (PageTable, Vec<f32>), vals: &[f32]) -> bool {
                let (from, to) = (t.1.len(), t.1.len() + vals.len());
                let shared_tail = from / 2 < t.0.pages().len() && Arc::strong_count(&t.0.pages()[from / 2]) > 1;
                let need = to.div_ceil(2) - t.0.pages().len() + usize::from(shared_tail);
                if need > pool.stats().free {
                    let before = t.0.ids();
                    if to.div_ceil(2) - t.0.pages().len() > pool.stats().free {
                        assert!(matches!(pool.reserve(&mut t.0, to), Err(ReserveError::Full(_))));
                    }
                    assert_eq!(t.0.ids(), before, "a reserve that does not fit changes nothing");
                    return false;
                }
                pool.reserve(&mut t.0, to).expect("counted");
                t.0.write_host(b, 0, from, vals, vals).expect("private pages");
                t.1.extend_from_slice(vals);
                true
            }
            for step in steps {
                match step {
                    Step::Fill { tokens, value } => {
                        let mut t = (pool.table(), Vec::new());
                        let vals: Vec<f32> = (0..tokens).map(|j| f32::from(value) + j as f32 / 16.0).collect();
                        if append(&mut pool, b.as_ref(), &mut t, &vals) {
                            live.push(t);
                        }
                    }
                    Step::Append { i, n, value } if i < live.len() => {
                        let vals = vec![f32::from(value); n];
                        append(&mut pool, b.as_ref(), &mut live[i], &vals);
                    }
                    Step::Share { i, pages } if i < live.len() => {
                        let pages = pages.min(live[i].1.len() / 2);
                        let src: Vec<&PageRef> = live[i].0.pages()[..pages].iter().collect();
                        let mut t = pool.table();
                        t.share(&src).expect("one store");
                        let vals = live[i].1[..pages * 2].to_vec();
                        live.push((t, vals));
                    }
                    Step::Rewind { i, tokens, value } if i < live.len() && tokens <= live[i].1.len() => {
                        let t = &mut live[i];
                        t.0.truncate(tokens);
                        t.1.truncate(tokens - 1);
                        if !append(&mut pool, b.as_ref(), t, &[f32::from(value)]) {
                            // The copy of a shared page did not fit: the table ends there.
                            t.0.truncate(tokens - 1);
                        }
                    }
                    Step::Drop { i } if i < live.len() => {
                        live.remove(i);
                    }
                    _ => {}
                }
                let mut held: Vec<u32> = live.iter().flat_map(|t| t.0.ids()).collect();
                held.sort_unstable();
                held.dedup();
                prop_assert_eq!(pool.stats().free, TOTAL - held.len());
                for (t, vals) in live.iter_mut() {
                    if !vals.is_empty() {
                        t.upload_ids(b.as_ref()).expect("ids");
                        prop_assert_eq!(&t.read(b.as_ref(), 0, vals.len()).0, &*vals);
                    }
                }
            }
            drop(live);
            prop_assert_eq!(pool.stats().free, TOTAL);
        }
    }
}
