//! Preprocessed media by content hash (issue 53). A conversation resends every earlier image each turn,
//! and each was base64-, PNG-decoded and resized again to count its placeholders, so a turn's time grew
//! with its history although the prefix cache held the images' rows. The same bytes give the same rows:
//! a hit is the item as it was, shared. Least recently used items go first past a byte budget.

use osprey_protocol::MediaHash;

use crate::PreparedItem;

/// The budget of [`Preprocessed`] in the tokenizer: 256 MiB of pixel rows (a 512×384 image is ~2.4 MB
/// of f32 rows with Qwen3.5's patches: ~100 such images).
pub(crate) const PREPROCESSED_BYTES: usize = 256 << 20;

/// Preprocessed items by content hash, at most `cap` bytes of rows.
#[derive(Debug)]
pub(crate) struct Preprocessed {
    items: lru::LruCache<MediaHash, PreparedItem>,
    bytes: usize,
    cap: usize,
}

impl Preprocessed {
    pub(crate) fn new(cap: usize) -> Self {
        Preprocessed { items: lru::LruCache::unbounded(), bytes: 0, cap }
    }

    /// The item of hash `h` (its spans empty: they are the prompt's), now the most recently used.
    pub(crate) fn get(&mut self, h: &MediaHash) -> Option<PreparedItem> {
        self.items.get(h).cloned()
    }

    /// Keeps `item` under `h`, dropping the least recently used past the budget (an item larger than the
    /// budget is not kept).
    pub(crate) fn put(&mut self, h: MediaHash, item: &PreparedItem) {
        let size = bytes(item);
        if size > self.cap || self.items.contains(&h) {
            return;
        }
        self.bytes += size;
        self.items.put(h, PreparedItem { spans: Vec::new(), ..item.clone() });
        while self.bytes > self.cap {
            let Some((_, old)) = self.items.pop_lru() else { break };
            self.bytes -= bytes(&old);
        }
    }
}

fn bytes(item: &PreparedItem) -> usize {
    item.patches.rows.len() * 4
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use osprey_protocol::vision::PixelPatches;

    use super::*;
    use crate::MediaPlaceholder;

    fn item(rows: usize) -> PreparedItem {
        PreparedItem {
            patches: Arc::new(PixelPatches { rows: vec![0.5; rows], grid: [1, 1, rows] }),
            is_video: false,
            placeholder: MediaPlaceholder::Image { tokens: rows },
            spans: vec![(3, rows)],
        }
    }

    /// A hit shares the rows (no copy) without the first prompt's spans; past the budget the least
    /// recently used goes first, and an item over the budget is not kept.
    #[test]
    fn hits_share_rows_and_the_budget_drops_the_least_recently_used() {
        let mut c = Preprocessed::new(100);
        let (a, b) = (item(10), item(10));
        c.put([1; 16], &a);
        c.put([2; 16], &b);
        let hit = c.get(&[1; 16]).expect("a");
        assert!(Arc::ptr_eq(&hit.patches, &a.patches) && hit.spans.is_empty());
        c.put([3; 16], &item(10)); // 120 bytes: b, used least lately, goes
        assert!(c.get(&[2; 16]).is_none() && c.get(&[1; 16]).is_some() && c.get(&[3; 16]).is_some());
        c.put([4; 16], &item(30));
        assert!(c.get(&[4; 16]).is_none(), "over the budget: not kept");
        assert_eq!(c.bytes, 80);
    }
}
