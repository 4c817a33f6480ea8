//! [`ShardedMap`]: the copy-on-write hash map behind every snapshot index.
//!
//! A snapshot index used to be one `Arc<HashMap>`: changing a single entry
//! while a reader still held the previous snapshot copied the whole map
//! (10,000 workloads → 10,000 entries cloned, then the old table freed).
//! A `ShardedMap` splits the entries over a power-of-two number of shards,
//! each its own `Arc<HashMap>`, chosen by the key's hash; the shard list is
//! itself behind one `Arc`. So:
//!
//! - cloning the map (every `StateWriter::begin`) bumps one reference count;
//! - the first write after a clone copies the shard list (pointers only) and
//!   the one shard it touches; further writes to the same shard in the same
//!   batch copy nothing;
//! - the number of shards grows with the map: 64 up to 16,384 entries, then
//!   within a factor of two of `√len` (256 at 100,000), so a write
//!   copies about as many shard pointers as shard entries and a one-entry
//!   update stays at microseconds from tiny maps to 100,000s of entries.
//!   Shards never shrink: a map that once was large stays cheap to change.
//!
//! Lookups take any `Q` the key borrows as (`&str` for `Arc<str>` keys),
//! like [`HashMap`]. One hasher per map picks the shard (from the hash's
//! middle bits) and hashes inside every shard (which use the low bits for
//! the bucket and the top bits for the tag), so the two never interfere.
//! The hasher is foldhash, randomly seeded: every operation hashes its key
//! twice (shard, then bucket), and with std's SipHash that made bulk ingest
//! ~30% slower and lookups ~2× slower than a single unsharded map; with
//! foldhash both are at least as fast as before. Keys come from the control
//! plane, not from traffic, so SipHash's flooding resistance buys nothing.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::sync::Arc;

use foldhash::fast::RandomState;

/// Shards of a new map: enough that an index never reshards below 16,384
/// entries (starting at 16 made bulk ingest of 10,000 workloads ~10%
/// slower), and cheap while empty: they share one empty table until
/// written.
const MIN_SHARDS: usize = 64;
/// Shards never exceed this (≈ 67 million entries before it binds).
const MAX_SHARDS: usize = 4096;
/// Grow once `len` reaches `GROWTH_AT * shards²` ...
const GROWTH_AT: usize = 4;
/// ... to this many times the shards.
const GROWTH_FACTOR: usize = 4;
/// The shard index comes from the hash bits starting here; hashbrown uses
/// the low bits (bucket) and the top 7 bits (tag) inside each shard.
const SHARD_BITS_SHIFT: u32 = 32;

type Shard<K, V> = HashMap<K, V, RandomState>;

/// A hash map whose clones share storage and whose writes copy only the
/// shard they touch: cloning is one reference count, a one-entry write
/// after a clone copies the shard pointers and one shard of about `√len`
/// entries. `len` is O(1); lookups hash the key twice (shard, bucket).
pub struct ShardedMap<K, V> {
    /// Always a power of two long, at least [`MIN_SHARDS`].
    shards: Arc<Vec<Arc<Shard<K, V>>>>,
    /// Entries over all shards.
    len: usize,
    /// Picks the shard; every shard hashes with a clone of it.
    hasher: RandomState,
}

impl<K, V> Clone for ShardedMap<K, V> {
    fn clone(&self) -> Self {
        Self {
            shards: Arc::clone(&self.shards),
            len: self.len,
            hasher: self.hasher,
        }
    }
}

impl<K, V> Default for ShardedMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: fmt::Debug, V: fmt::Debug> fmt::Debug for ShardedMap<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

fn empty_shards<K, V>(n: usize, capacity: usize, hasher: RandomState) -> Vec<Shard<K, V>> {
    (0..n)
        .map(|_| HashMap::with_capacity_and_hasher(capacity, hasher))
        .collect()
}

/// Which of `n` (a power of two) shards `hash` belongs to.
fn shard_of(hash: u64, n: usize) -> usize {
    ((hash >> SHARD_BITS_SHIFT) as usize) & (n - 1)
}

impl<K, V> ShardedMap<K, V> {
    /// An empty map.
    pub fn new() -> Self {
        let hasher = RandomState::default();
        // One shared empty table: the first write to a slot copies it.
        let empty = Arc::new(HashMap::with_hasher(hasher));
        Self {
            shards: Arc::new(vec![empty; MIN_SHARDS]),
            len: 0,
            hasher,
        }
    }

    /// Number of entries; O(1).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if there are no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.shards.iter().flat_map(|s| s.iter())
    }

    /// Every key, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.shards.iter().flat_map(|s| s.keys())
    }

    /// Every value, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.shards.iter().flat_map(|s| s.values())
    }

    /// True if `self` and `other` share all their storage (no write to
    /// either since one was cloned from the other).
    #[cfg(test)]
    pub(crate) fn ptr_eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.shards, &other.shards)
    }

    /// Number of shards.
    #[cfg(test)]
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Number of shards `self` and `other` share (same position, same
    /// allocation).
    #[cfg(test)]
    pub(crate) fn shared_shards(&self, other: &Self) -> usize {
        self.shards
            .iter()
            .zip(other.shards.iter())
            .filter(|(a, b)| Arc::ptr_eq(a, b))
            .count()
    }
}

impl<K: Hash + Eq, V> ShardedMap<K, V> {
    fn index<Q: Hash + ?Sized>(&self, key: &Q) -> usize {
        shard_of(self.hasher.hash_one(key), self.shards.len())
    }

    fn shard<Q: Hash + ?Sized>(&self, key: &Q) -> &Shard<K, V> {
        &self.shards[self.index(key)]
    }

    /// The value for `key`.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shard(key).get(key)
    }

    /// True if `key` has a value.
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.shard(key).contains_key(key)
    }
}

impl<K: Hash + Eq + Clone, V: Clone> ShardedMap<K, V> {
    /// Shard `i`, made unique (copied if shared) for writing.
    fn shard_mut(&mut self, i: usize) -> &mut Shard<K, V> {
        Arc::make_mut(&mut Arc::make_mut(&mut self.shards)[i])
    }

    /// Adds more shards if the map has outgrown its count; called before
    /// every insertion.
    fn grow_if_needed(&mut self) {
        let n = self.shards.len();
        if n < MAX_SHARDS && self.len >= GROWTH_AT * n * n {
            self.reshard((n * GROWTH_FACTOR).min(MAX_SHARDS));
        }
    }

    /// Redistributes every entry over `n` (a power of two) new shards,
    /// moving the entries of unshared shards and cloning the others.
    fn reshard(&mut self, n: usize) {
        let mut next = empty_shards(n, self.len / n + 1, self.hasher);
        for shard in Arc::unwrap_or_clone(std::mem::take(&mut self.shards)) {
            match Arc::try_unwrap(shard) {
                Ok(owned) => {
                    for (k, v) in owned {
                        next[shard_of(self.hasher.hash_one(&k), n)].insert(k, v);
                    }
                }
                Err(shared) => {
                    for (k, v) in shared.iter() {
                        next[shard_of(self.hasher.hash_one(k), n)].insert(k.clone(), v.clone());
                    }
                }
            }
        }
        self.shards = Arc::new(next.into_iter().map(Arc::new).collect());
    }

    /// Sets `key` to `value`; returns the value it replaces.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        self.grow_if_needed();
        let i = self.index(&key);
        let old = self.shard_mut(i).insert(key, value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    /// Removes `key`; returns its value. A missing key copies nothing.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = self.index(key);
        if !self.shards[i].contains_key(key) {
            return None;
        }
        let old = self.shard_mut(i).remove(key);
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    /// The value for `key`, to change in place. A missing key copies
    /// nothing.
    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let i = self.index(key);
        if !self.shards[i].contains_key(key) {
            return None;
        }
        self.shard_mut(i).get_mut(key)
    }

    /// The value for `key`, first set to `default()` if there is none.
    pub fn get_or_insert_with(&mut self, key: K, default: impl FnOnce() -> V) -> &mut V {
        self.grow_if_needed();
        let i = self.index(&key);
        let len = &mut self.len;
        let shard = Arc::make_mut(&mut Arc::make_mut(&mut self.shards)[i]);
        match shard.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                *len += 1;
                e.insert(default())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::{BTreeMap, HashSet};

    use super::*;

    fn key(i: usize) -> Arc<str> {
        Arc::from(format!("key-{i}"))
    }

    #[test]
    fn insert_overwrite_remove_keep_len() {
        let mut m: ShardedMap<Arc<str>, u32> = ShardedMap::new();
        assert!(m.is_empty());
        assert_eq!(m.insert(key(1), 1), None);
        assert_eq!(m.insert(key(2), 2), None);
        assert_eq!(m.len(), 2);
        // Overwrite: same len, old value back.
        assert_eq!(m.insert(key(1), 10), Some(1));
        assert_eq!(m.len(), 2);
        assert_eq!(m.get("key-1"), Some(&10));
        // &str lookups into Arc<str> keys.
        assert!(m.contains_key("key-2"));
        assert!(!m.contains_key("key-3"));
        // Removing a missing key changes nothing.
        assert_eq!(m.remove("key-3"), None);
        assert_eq!(m.len(), 2);
        assert_eq!(m.remove("key-1"), Some(10));
        assert_eq!(m.remove("key-1"), None);
        assert_eq!(m.len(), 1);
        assert_eq!(m.remove("key-2"), Some(2));
        assert!(m.is_empty());
        assert_eq!(m.iter().count(), 0);
    }

    #[test]
    fn get_mut_and_get_or_insert_with_keep_len() {
        let mut m: ShardedMap<Arc<str>, Vec<u32>> = ShardedMap::new();
        assert!(m.get_mut("a").is_none());
        m.get_or_insert_with(Arc::from("a"), Vec::new).push(1);
        m.get_or_insert_with(Arc::from("a"), Vec::new).push(2);
        assert_eq!(m.len(), 1);
        m.get_mut("a").unwrap().push(3);
        assert_eq!(m.get("a"), Some(&vec![1, 2, 3]));
        m.get_or_insert_with(Arc::from("b"), || vec![9]);
        assert_eq!(m.len(), 2);
        assert_eq!(m.get("b"), Some(&vec![9]));
    }

    #[test]
    fn many_entries_grow_shards_and_stay_findable() {
        let mut m = ShardedMap::new();
        let mut reference = BTreeMap::new();
        for i in 0..20_000usize {
            m.insert(key(i), i);
            reference.insert(key(i), i);
        }
        for i in (0..20_000usize).step_by(3) {
            assert_eq!(m.remove(&*key(i)), Some(i));
            reference.remove(&key(i));
        }
        for i in (0..20_000usize).step_by(5) {
            m.insert(key(i), i + 1);
            reference.insert(key(i), i + 1);
        }
        assert_eq!(m.len(), reference.len());
        assert!(m.shard_count() > MIN_SHARDS);
        assert!(m.shard_count().is_power_of_two());
        for (k, v) in &reference {
            assert_eq!(m.get(&**k), Some(v), "{k}");
        }
        // Iteration sees every entry exactly once.
        let seen: BTreeMap<_, _> = m.iter().map(|(k, v)| (k.clone(), *v)).collect();
        assert_eq!(seen, reference);
        assert_eq!(m.iter().count(), m.len());
        assert_eq!(m.keys().count(), m.len());
        assert_eq!(m.values().count(), m.len());
        // No shard holds much more than its share.
        let n = m.shard_count();
        let largest = m.shards.iter().map(|s| s.len()).max().unwrap();
        assert!(largest < 3 * m.len() / n, "{largest} of {} in {n}", m.len());
    }

    #[test]
    fn clone_is_unaffected_by_later_writes() {
        let mut m = ShardedMap::new();
        for i in 0..1000usize {
            m.insert(key(i), i);
        }
        let before = m.clone();
        assert!(before.ptr_eq(&m));

        m.insert(key(5), 500);
        m.insert(key(5000), 5000);
        m.remove("key-6");
        if let Some(v) = m.get_mut("key-7") {
            *v = 700;
        }
        m.get_or_insert_with(key(8000), || 8000);

        assert_eq!(before.len(), 1000);
        assert_eq!(before.get("key-5"), Some(&5));
        assert_eq!(before.get("key-6"), Some(&6));
        assert_eq!(before.get("key-7"), Some(&7));
        assert!(!before.contains_key("key-5000"));
        assert!(!before.contains_key("key-8000"));
        assert_eq!(before.iter().count(), 1000);

        assert_eq!(m.len(), 1001);
        assert_eq!(m.get("key-5"), Some(&500));
        assert_eq!(m.get("key-7"), Some(&700));
        assert!(!m.contains_key("key-6"));
    }

    #[test]
    fn clone_survives_resharding_of_the_original() {
        let mut m = ShardedMap::new();
        m.insert(key(0), 0usize);
        let before = m.clone();
        for i in 1..20_000usize {
            m.insert(key(i), i);
        }
        assert!(m.shard_count() > before.shard_count());
        assert_eq!(before.len(), 1);
        assert_eq!(before.get("key-0"), Some(&0));
        assert_eq!(m.len(), 20_000);
        assert!((0..20_000).all(|i| m.get(&*key(i)) == Some(&i)));
    }

    #[test]
    fn a_write_copies_only_the_shard_it_touches() {
        let mut m = ShardedMap::new();
        for i in 0..10_000usize {
            m.insert(key(i), i);
        }
        let n = m.shard_count();
        let before = m.clone();

        m.insert(key(42), 0);
        assert!(!before.ptr_eq(&m));
        assert_eq!(m.shared_shards(&before), n - 1);

        // More writes to the same shard in one batch copy nothing more.
        let touched: HashSet<usize> = [m.index("key-42")].into();
        m.insert(key(42), 1);
        assert_eq!(m.shared_shards(&before), n - touched.len());

        // Misses copy nothing.
        let mut c = before.clone();
        assert_eq!(c.remove("absent"), None);
        assert!(c.get_mut("absent").is_none());
        assert!(c.ptr_eq(&before));
    }
}
