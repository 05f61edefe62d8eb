//! Hashing a block on a second thread while the rest of it is still being received.
//!
//! A pulled block is read off the socket piece by piece straight into its slot, and every
//! byte is hashed (BLAKE3) before the block may be committed. Done in one thread, receive
//! and hash take turns, and the pulling thread is the bottleneck of a one-connection pull
//! (docs/benchmarks.md, "Where a pull's time goes"). Here a helper thread, one per pulling
//! chunk, hashes each piece as soon as it has landed while the pulling thread receives the
//! next: a block costs about max(receive, hash) plus one piece's hash instead of their sum.
//! The hash is the same BLAKE3 of the same bytes (the pieces are fed in order), so what is
//! committed, and when, is unchanged.

use std::sync::mpsc::{Receiver, SyncSender, channel, sync_channel};
use std::thread::JoinHandle;

use kvnode_proto::peer::HASH_LEN;

use crate::peer::PeerError;

/// Bytes hashed per message to the helper: small enough that the helper trails the
/// receiver by little at the end of a block, large enough to keep messages rare.
pub(super) const PIECE: usize = 128 << 10;

/// Blocks at least this long are hashed ahead; shorter ones are hashed by the pulling
/// thread itself (a hand-off costs more than hashing a few pieces).
pub(super) const MIN_BLOCK: usize = 4 * PIECE;

/// A filled piece of the block being hashed: its address and length.
struct Piece(*const u8, usize);

// SAFETY: a `Piece` is only created by `HashAhead::hash_while`, which keeps the bytes it
// points to borrowed (and writes none of them) until the helper has answered that block's
// `Finish`; the helper reads them only before answering.
unsafe impl Send for Piece {}

enum Job {
    Piece(Piece),
    Finish,
}

/// The helper thread of one pulling chunk; joined when dropped.
pub(super) struct HashAhead {
    jobs: Option<SyncSender<Job>>,
    sums: Receiver<[u8; HASH_LEN]>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HashAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashAhead").finish_non_exhaustive()
    }
}

impl HashAhead {
    /// Starts the helper thread.
    pub(super) fn spawn() -> std::io::Result<Self> {
        // A block is at most 64 MiB (MAX_BLOCK) = 512 pieces: the receiver never waits on
        // the queue for long, and a slow helper only delays the end of the block.
        let (jobs, rx) = sync_channel::<Job>(512);
        let (tx, sums) = channel();
        let thread = std::thread::Builder::new()
            .name("kvnode-peer-hash".into())
            .spawn(move || {
                let mut h = blake3::Hasher::new();
                while let Ok(job) = rx.recv() {
                    match job {
                        Job::Piece(Piece(at, len)) => {
                            // SAFETY: see `Piece`: the bytes are borrowed by the sender and
                            // unchanged until this block's `Finish` is answered below.
                            let bytes = unsafe { std::slice::from_raw_parts(at, len) };
                            h.update(bytes);
                        }
                        Job::Finish => {
                            if tx.send(*h.finalize().as_bytes()).is_err() {
                                return;
                            }
                            h.reset();
                        }
                    }
                }
            })?;
        Ok(Self {
            jobs: Some(jobs),
            sums,
            thread: Some(thread),
        })
    }

    /// Fills `dst` piece by piece with `fill(offset, piece)` while the helper hashes every
    /// filled piece; returns the BLAKE3 hash of all of `dst`, or `fill`'s first error. In
    /// every case (an error or a panic in `fill` too) it returns only after the helper is
    /// done with `dst`.
    pub(super) fn hash_while(
        &self,
        dst: &mut [u8],
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), PeerError>,
    ) -> Result<[u8; HASH_LEN], PeerError> {
        let jobs = self.jobs.as_ref().expect("helper running");
        let mut wait = WaitForHelper {
            jobs,
            sums: &self.sums,
            pending: false,
        };
        let mut at = 0;
        for piece in dst.chunks_mut(PIECE) {
            fill(at, piece)?;
            at += piece.len();
            wait.pending = true;
            if jobs
                .send(Job::Piece(Piece(piece.as_ptr(), piece.len())))
                .is_err()
            {
                return Err(helper_gone());
            }
        }
        wait.pending = true;
        wait.finish()
    }
}

fn helper_gone() -> PeerError {
    crate::peer::PullError::HashThreadStopped.into()
}

/// Waits for the helper's answer to the block in progress, also when the block ends early.
struct WaitForHelper<'a> {
    jobs: &'a SyncSender<Job>,
    sums: &'a Receiver<[u8; HASH_LEN]>,
    /// Pieces were sent and their `Finish` not yet answered.
    pending: bool,
}

impl WaitForHelper<'_> {
    fn finish(&mut self) -> Result<[u8; HASH_LEN], PeerError> {
        self.pending = false;
        self.jobs.send(Job::Finish).map_err(|_| helper_gone())?;
        // A helper that stopped (its end of the channel dropped) reads nothing any more.
        self.sums.recv().map_err(|_| helper_gone())
    }
}

impl Drop for WaitForHelper<'_> {
    fn drop(&mut self) {
        if self.pending {
            let _ = self.finish();
        }
    }
}

impl Drop for HashAhead {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::error::WireError;

    #[test]
    fn the_hash_is_blake3_of_the_whole_block_whatever_its_length() {
        let h = HashAhead::spawn().unwrap();
        for len in [0, 1, PIECE - 1, PIECE, PIECE + 1, 5 * PIECE + 77, 3 << 20] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut dst = vec![0u8; len];
            let sum = h
                .hash_while(&mut dst, |at, piece| {
                    piece.copy_from_slice(&src[at..at + piece.len()]);
                    Ok(())
                })
                .unwrap();
            assert_eq!(dst, src);
            assert_eq!(sum, *blake3::hash(&src).as_bytes(), "len {len}");
        }
    }

    #[test]
    fn a_block_that_fails_half_way_leaves_the_next_one_hashed_right() {
        let h = HashAhead::spawn().unwrap();
        let mut dst = vec![0u8; 4 * PIECE];
        let e = h.hash_while(&mut dst, |at, piece| {
            if at >= 2 * PIECE {
                return Err(WireError::Truncated {
                    got: at,
                    want: 4 * PIECE,
                }
                .into());
            }
            piece.fill(1);
            Ok(())
        });
        assert!(matches!(
            e,
            Err(PeerError::Wire(WireError::Truncated { .. }))
        ));
        // The pieces of the failed block are not mixed into the next block's hash.
        let src = vec![9u8; 4 * PIECE];
        let sum = h
            .hash_while(&mut dst, |at, piece| {
                piece.copy_from_slice(&src[at..at + piece.len()]);
                Ok(())
            })
            .unwrap();
        assert_eq!(sum, *blake3::hash(&src).as_bytes());
    }
}
