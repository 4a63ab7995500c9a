//! A bounded map of what was used recently, for lookups an engine saves itself (a conversation's
//! owner and agent).

use std::collections::HashMap;
use std::hash::Hash;

/// At most `2 × half` entries, in two generations of at most `half`: an entry found in the older
/// one moves to the newer, and when the newer is full the older is dropped and the newer takes its
/// place. So an entry used within the last `half` insertions is kept, and a full map forgets its
/// least recently used half, never everything at once.
#[derive(Debug)]
pub(super) struct Recent<K, V> {
    new: HashMap<K, V>,
    old: HashMap<K, V>,
    half: usize,
}

impl<K: Eq + Hash + Clone, V: Clone> Recent<K, V> {
    /// Keeps at most `kept` entries (at least two).
    pub(super) fn new(kept: usize) -> Self {
        Self { new: HashMap::new(), old: HashMap::new(), half: (kept / 2).max(1) }
    }

    pub(super) fn get(&mut self, key: &K) -> Option<V> {
        if let Some(value) = self.new.get(key) {
            return Some(value.clone());
        }
        let value = self.old.remove(key)?;
        self.insert(key.clone(), value.clone());
        Some(value)
    }

    pub(super) fn insert(&mut self, key: K, value: V) {
        if self.new.len() >= self.half && !self.new.contains_key(&key) {
            self.old = std::mem::take(&mut self.new);
        }
        self.old.remove(&key);
        self.new.insert(key, value);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.new.len() + self.old.len()
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;

    #[test]
    fn a_full_map_forgets_what_was_not_used_lately_and_keeps_what_was() {
        let mut recent = Recent::new(8);
        for n in 0..4 {
            recent.insert(n, n * 10);
        }
        // the newer generation full: the next insert makes it the older one
        for n in 4..8 {
            recent.insert(n, n * 10);
        }
        assert_eq!(recent.len(), 8);
        // used: moved to the newer generation
        assert_eq!(recent.get(&1), Some(10));
        for n in 8..11 {
            recent.insert(n, n * 10);
        }
        // the older generation's others (0, 2, 3) dropped once the newer was full again (as 1
        // moved up); 1 was used, so kept
        assert_eq!(recent.get(&0), None);
        assert_eq!(recent.get(&2), None);
        assert_eq!(recent.get(&1), Some(10));
        assert_eq!(recent.get(&10), Some(100));
        assert!(recent.len() <= 8, "bounded: {}", recent.len());
        // never more than the bound, whatever comes
        for n in 100..1_000 {
            recent.insert(n, n);
            assert!(recent.len() <= 8);
        }
        assert_eq!(recent.get(&999), Some(999));
    }

    #[test]
    fn an_entry_inserted_again_is_kept_once() {
        let mut recent = Recent::new(4);
        recent.insert("a", 1);
        recent.insert("b", 2);
        recent.insert("c", 3);
        recent.insert("a", 4);
        assert_eq!(recent.get(&"a"), Some(4));
        assert!(recent.len() <= 4);
    }
}
