//! A list that any thread appends to and one consumer takes whole.

use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Acquire, Release};

/// Items handed from producers to one consumer. Taking is a single atomic load while nothing
/// was added, so a consumer may look before every operation it handles.
#[derive(Debug)]
pub(crate) struct Handoff<T> {
    pending: AtomicBool,
    list: Mutex<Vec<T>>,
}

impl<T> Default for Handoff<T> {
    fn default() -> Self {
        Self {
            pending: AtomicBool::new(false),
            list: Mutex::new(Vec::new()),
        }
    }
}

impl<T> Handoff<T> {
    /// Appends `items` (nothing to do for none).
    pub fn extend(&self, items: impl IntoIterator<Item = T>) {
        let mut l = self
            .list
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = l.len();
        l.extend(items);
        if l.len() > before {
            self.pending.store(true, Release);
        }
    }

    /// Everything appended since the last call.
    pub fn take(&self) -> Vec<T> {
        if !self.pending.swap(false, Acquire) {
            return Vec::new();
        }
        std::mem::take(
            &mut *self
                .list
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_appended_is_taken_once_in_order() {
        let h = Handoff::default();
        assert!(h.take().is_empty());
        h.extend([1, 2]);
        h.extend([]);
        h.extend([3]);
        assert_eq!(h.take(), [1, 2, 3]);
        assert!(h.take().is_empty());
    }
}
