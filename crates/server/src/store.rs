//! The Responses API's conversation store: what `previous_response_id` continues from. In memory,
//! least recently used first out, bounded by a count and by bytes (a stored conversation holds its
//! messages as sent, media data URLs included, so bytes are what a client can make it hold).

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;
use serde_json::Value;

/// One stored response.
#[derive(Clone, Debug)]
pub struct Stored {
    /// The conversation up to and including this response's output, as chat messages (instructions
    /// excluded: they do not carry over).
    pub messages: Vec<Value>,
    /// The response object (for `GET /v1/responses/{id}`).
    pub response: Value,
    bytes: usize,
}

impl Stored {
    /// A stored response; its size is what its trees take in memory ([`heap_bytes`]), not their JSON
    /// text: `[[],[],…]` is 3 bytes of JSON per element and 72 bytes of memory.
    pub fn new(messages: Vec<Value>, response: Value) -> Self {
        let bytes = messages.iter().map(heap_bytes).sum::<usize>() + heap_bytes(&response);
        Stored { messages, response, bytes }
    }
}

/// Bytes a JSON tree holds in memory: the value itself, string and vector capacities, and per object
/// member its key and an index-map slot (`preserve_order`: entries plus a hash index).
pub fn heap_bytes(v: &Value) -> usize {
    const VALUE: usize = std::mem::size_of::<Value>();
    // An index map entry: the key's String, the value, a hash; plus the index table's slot.
    const MEMBER: usize = std::mem::size_of::<String>() + VALUE + 8 + 8;
    match v {
        Value::String(s) => VALUE + s.capacity(),
        Value::Array(a) => VALUE + (a.capacity() - a.len()) * VALUE + a.iter().map(heap_bytes).sum::<usize>(),
        Value::Object(m) => VALUE + m.iter().map(|(k, x)| MEMBER - VALUE + k.capacity() + heap_bytes(x)).sum::<usize>(),
        _ => VALUE,
    }
}

/// The store.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<(LruCache<String, Stored>, usize)>,
    max_bytes: usize,
    enabled: bool,
}

impl ResponseStore {
    /// Holds at most `max_count` responses and `max_bytes` bytes.
    pub fn new(max_count: usize, max_bytes: usize) -> Self {
        let cap = NonZeroUsize::new(max_count.max(1)).unwrap_or(NonZeroUsize::MIN);
        ResponseStore { inner: Mutex::new((LruCache::new(cap), 0)), max_bytes, enabled: max_count > 0 }
    }

    /// Whether `s` can be kept (the store is on and `s` is within its byte bound).
    pub fn fits(&self, s: &Stored) -> bool {
        self.enabled && s.bytes <= self.max_bytes
    }

    /// Keeps `s` under `id`, dropping the least recently used entries to stay within bounds (an entry
    /// larger than the byte bound is not kept).
    pub fn put(&self, id: String, s: Stored) {
        if !self.fits(&s) {
            return;
        }
        let mut g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (cache, bytes) = &mut *g;
        *bytes += s.bytes;
        if let Some((_, old)) = cache.push(id, s) {
            *bytes -= old.bytes;
        }
        while *bytes > self.max_bytes {
            match cache.pop_lru() {
                Some((_, old)) => *bytes -= old.bytes,
                None => break,
            }
        }
    }

    /// The response stored under `id`.
    pub fn get(&self, id: &str) -> Option<Stored> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).0.get(id).cloned()
    }

    /// Forgets `id`; whether it was there.
    pub fn remove(&self, id: &str) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (cache, bytes) = &mut *g;
        match cache.pop(id) {
            Some(old) => {
                *bytes -= old.bytes;
                true
            }
            None => false,
        }
    }

    /// Responses held and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        (g.0.len(), g.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_by_count_and_bytes() {
        let msg = |n: usize| vec![Value::String("x".repeat(n))];
        let s = ResponseStore::new(2, 1000);
        s.put("a".into(), Stored::new(msg(10), Value::Null));
        s.put("b".into(), Stored::new(msg(10), Value::Null));
        s.put("c".into(), Stored::new(msg(10), Value::Null));
        assert!(s.get("a").is_none() && s.get("b").is_some() && s.get("c").is_some(), "count bound");
        s.put("d".into(), Stored::new(msg(800), Value::Null));
        assert_eq!(s.usage().0, 1, "byte bound drops the older ones: {:?}", s.usage());
        assert!(s.get("d").is_some());
        s.put("huge".into(), Stored::new(msg(5000), Value::Null));
        assert!(s.get("huge").is_none(), "larger than the bound: not kept");
        assert!(s.remove("d") && s.usage() == (0, 0));
        // Memory, not JSON text: 1,000 empty arrays are ~3 KB of JSON and 72 KB of values (a `Value` is 72 bytes with `preserve_order`).
        let arrays = Value::Array(vec![Value::Array(Vec::new()); 1000]);
        assert!(heap_bytes(&arrays) >= 32_000, "{}", heap_bytes(&arrays));
        assert!(!s.fits(&Stored::new(vec![arrays], Value::Null)));
        let off = ResponseStore::new(0, 1000);
        off.put("a".into(), Stored::new(msg(1), Value::Null));
        assert!(off.get("a").is_none());
    }
}
