//! A one-shot completion handle: block on it with `wait` or `.await` it from any executor.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};

enum State<T> {
    Pending(Option<Waker>),
    Ready(T),
    Taken,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
}

/// Receives the result of one spill operation.
///
/// Implements [`Future`], so a tokio task can `.await` it without blocking a runtime thread;
/// synchronous callers use [`Completion::wait`]. Every submitted operation completes exactly once
/// (the IO worker completes queued operations with [`crate::SpillError::Stopped`] on shutdown).
pub struct Completion<T> {
    shared: Arc<Shared<T>>,
}

/// The sending half, owned by the operation on the worker.
pub(crate) struct Completer<T> {
    shared: Arc<Shared<T>>,
}

pub(crate) fn pair<T>() -> (Completer<T>, Completion<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State::Pending(None)),
        cv: Condvar::new(),
    });
    (
        Completer {
            shared: shared.clone(),
        },
        Completion { shared },
    )
}

/// Builds an already-completed handle (used when an operation is refused before queuing).
pub(crate) fn ready<T>(v: T) -> Completion<T> {
    let (c, r) = pair();
    c.complete(v);
    r
}

impl<T> Completer<T> {
    pub(crate) fn complete(self, v: T) {
        let mut st = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let State::Pending(Some(w)) = std::mem::replace(&mut *st, State::Ready(v)) {
            w.wake();
        }
        drop(st);
        self.shared.cv.notify_all();
    }
}

impl<T> Completion<T> {
    /// Blocks the calling thread until the operation finished.
    pub fn wait(self) -> T {
        let mut st = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let State::Ready(_) = &*st
                && let State::Ready(v) = std::mem::replace(&mut *st, State::Taken)
            {
                return v;
            }
            st = self
                .shared
                .cv
                .wait(st)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Returns the result if the operation already finished.
    pub fn try_take(&mut self) -> Option<T> {
        let mut st = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match std::mem::replace(&mut *st, State::Taken) {
            State::Ready(v) => Some(v),
            other => {
                *st = other;
                None
            }
        }
    }

    /// True once the result is available.
    pub fn is_ready(&self) -> bool {
        let st = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        matches!(*st, State::Ready(_))
    }
}

impl<T> Future for Completion<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut st = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match std::mem::replace(&mut *st, State::Taken) {
            State::Ready(v) => Poll::Ready(v),
            State::Pending(_) => {
                *st = State::Pending(Some(cx.waker().clone()));
                Poll::Pending
            }
            State::Taken => panic!("Completion polled after it returned Ready"),
        }
    }
}

impl<T> std::fmt::Debug for Completion<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("ready", &self.is_ready())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_returns_value_completed_on_another_thread() {
        let (c, r) = pair::<u32>();
        let t = std::thread::spawn(move || c.complete(7));
        assert_eq!(r.wait(), 7);
        t.join().unwrap();
    }

    #[test]
    fn poll_wakes_the_registered_waker() {
        struct Flag(std::sync::atomic::AtomicBool);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let flag = Arc::new(Flag(false.into()));
        let waker = Waker::from(flag.clone());
        let (c, mut r) = pair::<u32>();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut r).poll(&mut cx).is_pending());
        c.complete(3);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(Pin::new(&mut r).poll(&mut cx), Poll::Ready(3));
    }
}
