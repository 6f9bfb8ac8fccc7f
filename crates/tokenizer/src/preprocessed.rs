//! Preprocessed media by content hash (issue 53). A conversation resends every earlier image each turn,
//! and each was base64-, PNG-decoded and resized again to count its placeholders, so a turn's time grew
//! with its history although the prefix cache held the images' rows. The same bytes give the same rows
//! and the same placeholder: a hit is the item as it was, shared.
//!
//! Two budgets, because the two halves differ 10,000-fold in size. Pixel rows (~4.7 MB for a 512×384
//! image) are kept to a byte budget, least recently used first out. An item's *shape* (its grid and
//! placeholder, ~100 bytes) is kept far longer: a resent item whose rows went out is laid out from its
//! shape and its rows are made from its bytes only if the vision encoder asks for them (its own cache
//! and the prefix cache answer first). A conversation cycling through more images than the row budget
//! holds evicted each image just before it came round again, so all of them were decoded every turn.

use std::sync::Arc;

use osprey_protocol::vision::{MakePixels, Pixels};
use osprey_protocol::MediaHash;

use crate::{MediaPlaceholder, PreparedItem};

/// The budget of [`Preprocessed`]'s rows in the tokenizer: 256 MiB of pixel rows (~54 images of
/// 512×384 with Qwen3.5's patches).
pub(crate) const PREPROCESSED_BYTES: usize = 256 << 20;

/// Shapes kept: far more media than one request may carry (`--max-media-per-request`, 256 by default).
pub(crate) const SHAPES: usize = 1 << 14;

/// What an item's prompt layout needs, without its rows.
#[derive(Clone, Debug)]
struct Shape {
    grid: [usize; 3],
    is_video: bool,
    placeholder: MediaPlaceholder,
}

/// Preprocessed items by content hash: rows to a byte budget, shapes to a count.
#[derive(Debug)]
pub(crate) struct Preprocessed {
    rows: lru::LruCache<MediaHash, Arc<Pixels>>,
    shapes: lru::LruCache<MediaHash, Shape>,
    bytes: usize,
    cap: usize,
}

impl Preprocessed {
    pub(crate) fn new(cap: usize, shapes: usize) -> Self {
        let shapes = std::num::NonZeroUsize::new(shapes.max(1)).expect("at least one");
        Preprocessed { rows: lru::LruCache::unbounded(), shapes: lru::LruCache::new(shapes), bytes: 0, cap }
    }

    /// The item of hash `h` (its spans empty: they are the prompt's), now the most recently used: its
    /// rows shared if kept, else made by `make` when first asked for.
    pub(crate) fn get(&mut self, h: &MediaHash, make: impl FnOnce() -> MakePixels) -> Option<PreparedItem> {
        let shape = self.shapes.get(h)?.clone();
        let patches = match self.rows.get(h) {
            Some(p) => p.clone(),
            None => Arc::new(Pixels::deferred(shape.grid, make())),
        };
        Some(PreparedItem { patches, is_video: shape.is_video, placeholder: shape.placeholder, spans: Vec::new() })
    }

    /// Keeps `item`'s shape under `h`, and its rows if they are made, dropping the least recently used
    /// rows past the budget (rows larger than the budget are not kept).
    pub(crate) fn put(&mut self, h: MediaHash, item: &PreparedItem) {
        let shape = Shape { grid: item.patches.grid(), is_video: item.is_video, placeholder: item.placeholder.clone() };
        self.shapes.put(h, shape);
        let size = bytes(&item.patches);
        if item.patches.made().is_none() || size > self.cap || self.rows.contains(&h) {
            return;
        }
        self.bytes += size;
        self.rows.put(h, item.patches.clone());
        while self.bytes > self.cap {
            let Some((_, old)) = self.rows.pop_lru() else { break };
            self.bytes -= bytes(&old);
        }
    }
}

fn bytes(p: &Pixels) -> usize {
    p.made().map_or(0, |p| p.rows.len() * 4)
}

#[cfg(test)]
mod tests {
    use osprey_protocol::vision::PixelPatches;
    use osprey_protocol::{ErrorCode, RequestError};

    use super::*;

    fn item(rows: usize) -> PreparedItem {
        let p = PixelPatches { rows: vec![0.5; rows], grid: [1, 1, rows] };
        PreparedItem {
            patches: Arc::new(Pixels::ready(Arc::new(p))),
            is_video: false,
            placeholder: MediaPlaceholder::Image { tokens: rows },
            spans: vec![(3, rows)],
        }
    }

    fn never() -> MakePixels {
        Box::new(|| Err(RequestError::new(ErrorCode::EngineError, "not asked for in this test")))
    }

    /// A hit shares the rows (no copy) without the first prompt's spans; past the budget the least
    /// recently used rows go first and the item comes back deferred with its shape; rows over the budget
    /// are not kept; past the shape count the item is unknown.
    #[test]
    fn hits_share_rows_and_the_budget_drops_the_least_recently_used() {
        let mut c = Preprocessed::new(100, 3);
        let (a, b) = (item(10), item(10));
        c.put([1; 16], &a);
        c.put([2; 16], &b);
        let hit = c.get(&[1; 16], never).expect("a");
        assert!(Arc::ptr_eq(&hit.patches, &a.patches) && hit.spans.is_empty());
        c.put([3; 16], &item(10)); // 120 bytes: b's rows, used least lately, go
        let b2 = c.get(&[2; 16], never).expect("b's shape");
        assert!(b2.patches.made().is_none() && b2.patches.grid() == [1, 1, 10]);
        assert_eq!(b2.placeholder, MediaPlaceholder::Image { tokens: 10 });
        assert!(c.get(&[1; 16], never).expect("a").patches.made().is_some());
        c.put([4; 16], &item(30));
        let d = c.get(&[4; 16], never).expect("d's shape");
        assert!(d.patches.made().is_none(), "over the budget: rows not kept");
        assert_eq!(c.bytes, 80);
        // Three shapes: 3's was used least lately.
        assert!(c.get(&[3; 16], never).is_none() && c.get(&[2; 16], never).is_some());
    }
}
