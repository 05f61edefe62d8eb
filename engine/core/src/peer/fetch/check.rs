//! How the destination reads a block body off the wire and checks it: in 128 KiB pieces, each
//! folded into the block MAC (keyed plaintext sessions, `kvnode_blockmac`) or hashed with
//! BLAKE3 while still in cache (by a helper thread for large blocks), or, encrypted, opened
//! whole and then hashed.

use std::time::Duration;

use kvnode_proto::peer::HASH_LEN;

use super::hash_ahead::{self, HashAhead};
use super::machine::Checked;
use crate::peer::PeerError;
use crate::peer::error::WireError;
use crate::peer::transport::{PullConn as _, PullWire};
use kvnode_blockmac::{MacState, TAG_LEN, tags_equal};

/// Payloads are read and hashed in pieces of this size, so each piece is hashed while it is
/// still in cache instead of re-reading the whole block from memory afterwards.
const HASH_PIECE: usize = 128 << 10;

/// Fills `dst` with the next payload bytes (decrypted when the session encrypts); returns
/// their BLAKE3 hash.
pub(super) fn read_hashed(
    w: &mut PullWire,
    dst: &mut [u8],
    seal: &[u8],
    io: Duration,
    ahead: Option<&HashAhead>,
) -> Result<[u8; HASH_LEN], PeerError> {
    let total = dst.len();
    if let Some(h) = ahead.filter(|_| !w.encrypted() && total >= hash_ahead::MIN_BLOCK) {
        return h.hash_while(dst, |at, piece| {
            w.read_payload(piece, io).map_err(at_offset(at, total))
        });
    }
    let mut h = blake3::Hasher::new();
    let encrypted = w.encrypted();
    read_pieces(w, dst, io, |piece| {
        if !encrypted {
            h.update(piece);
        }
    })?;
    if encrypted {
        // AES-GCM is checked over the whole body; only then is it hashed.
        w.open_payload(dst, seal)?;
        for piece in dst.chunks(HASH_PIECE) {
            h.update(piece);
        }
    }
    Ok(*h.finalize().as_bytes())
}

/// A short read of the piece at `at` as a short read of the whole `total`-byte body.
fn at_offset(at: usize, total: usize) -> impl Fn(PeerError) -> PeerError {
    move |e| match e {
        PeerError::Wire(WireError::Truncated { got, .. }) => WireError::Truncated {
            got: at + got,
            want: total,
        }
        .into(),
        e => e,
    }
}

/// Fills `dst` from the wire in [`HASH_PIECE`] pieces, handing each to `each` as soon as
/// it has landed (still in cache).
fn read_pieces(
    w: &mut PullWire,
    dst: &mut [u8],
    io: Duration,
    mut each: impl FnMut(&[u8]),
) -> Result<(), PeerError> {
    let total = dst.len();
    let mut at = 0;
    for piece in dst.chunks_mut(HASH_PIECE) {
        w.read_payload(piece, io).map_err(at_offset(at, total))?;
        each(piece);
        at += piece.len();
    }
    Ok(())
}

/// Fills `dst` with the next payload bytes and checks them: against the block MAC of a
/// keyed plaintext session, when the source sent one and this CPU computes it (one fast
/// pass as the pieces land); else by BLAKE3 ([`read_hashed`]).
pub(super) fn read_checked(
    w: &mut PullWire,
    dst: &mut [u8],
    seal: &[u8],
    io: Duration,
    ahead: Option<&HashAhead>,
) -> Result<Checked, PeerError> {
    let mac = (!w.encrypted() && seal.len() == TAG_LEN)
        .then(|| w.block_mac())
        .flatten();
    let Some(m) = mac else {
        return read_hashed(w, dst, seal, io, ahead).map(Checked::Hashed);
    };
    let mut st = MacState::default();
    read_pieces(w, dst, io, |piece| m.update(&mut st, piece))?;
    let tag = m.finish(st);
    Ok(Checked::Tagged {
        ok: tags_equal(&tag, seal),
        id: m.id(),
        tag,
    })
}
