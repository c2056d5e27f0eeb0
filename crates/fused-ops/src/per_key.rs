//! Values kept for the life of the process, one per key: what the CUDA launchers keep
//! per stream (scratch sized before a launch), per context (values asked of the driver
//! once) and per device (library handles). Host code, so its tests run without a GPU.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

use candle_core::Result;

/// One `T` per key, made on first use and remade when it no longer fits.
pub struct PerKey<K, T> {
    by_key: Mutex<Option<HashMap<K, T>>>,
    /// Values replaced because they no longer fitted, kept for the process: a CUDA
    /// graph captured while one was in use still addresses its buffers. They are
    /// replaced only by larger ones, so the memory kept stays bounded.
    retired: Mutex<Vec<T>>,
}

impl<K: Eq + Hash, T> Default for PerKey<K, T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Eq + Hash, T> PerKey<K, T> {
    pub const fn new() -> Self {
        Self {
            by_key: Mutex::new(None),
            retired: Mutex::new(Vec::new()),
        }
    }

    /// Runs `use_it` with the value kept for `key`, first made by `make` where there is
    /// none or `fits` refuses the one kept. The lock is held while `use_it` runs, so
    /// two host threads never share a value at once.
    pub fn with<R>(
        &self,
        key: K,
        fits: impl FnOnce(&T) -> bool,
        make: impl FnOnce() -> Result<T>,
        use_it: impl FnOnce(&mut T) -> Result<R>,
    ) -> Result<R> {
        let mut guard = self.by_key.lock().expect("per-key lock");
        let map = guard.get_or_insert_with(HashMap::new);
        let value = match map.entry(key) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                if !fits(e.get()) {
                    let old = e.insert(make()?);
                    self.retired.lock().expect("retired lock").push(old);
                }
                e.into_mut()
            }
            std::collections::hash_map::Entry::Vacant(e) => e.insert(make()?),
        };
        use_it(value)
    }

    /// The value kept for `key`, made by `make` the first time: for values that never
    /// change once asked for.
    pub fn once(&self, key: K, make: impl FnOnce() -> Result<T>) -> Result<T>
    where
        T: Copy,
    {
        self.with(key, |_| true, make, |value| Ok(*value))
    }

    /// Keeps `value` for `key`, in place of any value kept before.
    pub fn put(&self, key: K, value: T) {
        let mut guard = self.by_key.lock().expect("per-key lock");
        guard.get_or_insert_with(HashMap::new).insert(key, value);
    }

    /// Runs `read` with the value kept for `key`, if any.
    pub fn peek<R>(&self, key: &K, read: impl FnOnce(Option<&T>) -> R) -> R {
        let guard = self.by_key.lock().expect("per-key lock");
        read(guard.as_ref().and_then(|map| map.get(key)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_made_once_a_key_and_remade_only_when_it_no_longer_fits() -> Result<()> {
        let kept: PerKey<usize, Vec<u8>> = PerKey::new();
        let made = std::cell::Cell::new(0);
        let make = |len: usize| {
            made.set(made.get() + 1);
            Ok(vec![0u8; len])
        };
        let fits = |want: usize| move |v: &Vec<u8>| v.len() >= want;
        // Key 1: made at 4, kept for 2 (it fits), remade at 8.
        assert_eq!(kept.with(1, fits(4), || make(4), |v| Ok(v.len()))?, 4);
        assert_eq!(kept.with(1, fits(2), || make(2), |v| Ok(v.len()))?, 4);
        assert_eq!(kept.with(1, fits(8), || make(8), |v| Ok(v.len()))?, 8);
        assert_eq!(made.get(), 2);
        // Key 2 has its own value; `use_it` may change it in place.
        kept.with(
            2,
            fits(1),
            || make(1),
            |v| {
                v[0] = 7;
                Ok(())
            },
        )?;
        assert_eq!(kept.peek(&2, |v| v.map(|v| v[0])), Some(7));
        assert!(kept.peek(&3, |v| v.is_none()));
        // A failed make keeps nothing and says why.
        let e = kept.with(3, fits(1), || candle_core::bail!("no memory"), |_| Ok(()));
        assert!(e.unwrap_err().to_string().contains("no memory"));
        assert!(kept.peek(&3, |v| v.is_none()));
        // `put` replaces; `once` asks only the first time.
        kept.put(1, vec![1, 2]);
        assert_eq!(kept.peek(&1, |v| v.map(Vec::len)), Some(2));
        let asked: PerKey<(usize, usize), usize> = PerKey::new();
        assert_eq!(asked.once((0, 5), || Ok(42))?, 42);
        assert_eq!(
            asked.once((0, 5), || candle_core::bail!("asked twice"))?,
            42
        );
        assert_eq!(asked.once((1, 5), || Ok(43))?, 43);
        Ok(())
    }
}
