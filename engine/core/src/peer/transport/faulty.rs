//! A fault-injecting transport for tests: TCP whose Nth received block is cut short or
//! arrives corrupted, so the fetch path's reactions can be pinned without a real fault. (A
//! stall is tested against a real silent source instead, so that the reader's own timeout is
//! what is measured.)

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use kvnode_proto::peer::PeerMsg;
use serde::{Deserialize, Serialize};

use super::{Frame, NoSlots, PullConn, TcpPull};
use crate::peer::PeerError;
use crate::peer::error::WireError;

/// Which received blocks go wrong. Blocks are numbered from 1 in the order this daemon
/// receives their headers, over all its dialled connections. Default: no faults.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultPlan {
    /// This block is cut after `cut_after` bytes and its connection closes.
    pub cut_block: Option<u32>,
    /// Bytes of the cut block delivered before the cut. Default: 0.
    pub cut_after: u32,
    /// This block's first byte arrives flipped.
    pub corrupt_block: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Cut(usize),
    Corrupt,
}

/// A pulling TCP connection that injects a [`FaultPlan`]'s faults where bytes land.
#[derive(Debug)]
pub struct FaultyConn {
    inner: TcpPull,
    plan: FaultPlan,
    seen: Arc<AtomicU32>,
    /// Fault of the block being read, and bytes of it delivered so far.
    cur: Option<Fault>,
    pos: usize,
    dead: bool,
}

impl FaultyConn {
    /// Wraps `inner`; `seen` counts blocks received across connections.
    pub fn new(inner: TcpPull, plan: FaultPlan, seen: Arc<AtomicU32>) -> Self {
        Self {
            inner,
            plan,
            seen,
            cur: None,
            pos: 0,
            dead: false,
        }
    }

    fn fault_of(&self, n: u32) -> Option<Fault> {
        let p = &self.plan;
        if p.cut_block == Some(n) {
            Some(Fault::Cut(p.cut_after as usize))
        } else if p.corrupt_block == Some(n) {
            Some(Fault::Corrupt)
        } else {
            None
        }
    }

    /// A cut connection is closed.
    fn gate(&self) -> Result<(), PeerError> {
        if self.dead {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe).into());
        }
        Ok(())
    }
}

impl PullConn for FaultyConn {
    type Slots = NoSlots;

    /// See [`PullConn::send_early`] (a cut connection refuses it like any send).
    fn send_early(&mut self, msgs: &[PeerMsg]) -> Result<(), PeerError> {
        self.gate()?;
        self.inner.send_early(msgs)
    }

    fn block_mac(&self) -> Option<std::sync::Arc<kvnode_blockmac::BlockMac>> {
        self.inner.block_mac()
    }

    fn slots(&mut self) -> Option<&mut NoSlots> {
        None
    }

    fn remote(&self) -> SocketAddr {
        self.inner.remote()
    }

    fn send_all(&mut self, msgs: &[PeerMsg], limit: Duration) -> Result<(), PeerError> {
        self.gate()?;
        self.inner.send_all(msgs, limit)
    }

    fn recv(&mut self, limit: Duration) -> Result<Frame, PeerError> {
        self.gate()?;
        let f = self.inner.recv(limit)?;
        if matches!(f.0, PeerMsg::Block { .. }) {
            let n = self.seen.fetch_add(1, Ordering::Relaxed) + 1;
            self.cur = self.fault_of(n);
            self.pos = 0;
        }
        Ok(f)
    }

    fn read_payload(&mut self, dst: &mut [u8], limit: Duration) -> Result<(), PeerError> {
        self.gate()?;
        match self.cur {
            Some(Fault::Cut(at)) if self.pos + dst.len() > at => {
                let k = at.saturating_sub(self.pos);
                self.inner.read_payload(&mut dst[..k], limit)?;
                self.dead = true;
                Err(WireError::Truncated {
                    got: k,
                    want: dst.len(),
                }
                .into())
            }
            fault => {
                self.inner.read_payload(dst, limit)?;
                if fault == Some(Fault::Corrupt)
                    && self.pos == 0
                    && let Some(b) = dst.first_mut()
                {
                    *b ^= 0xff;
                }
                self.pos += dst.len();
                Ok(())
            }
        }
    }

    fn open_payload(&mut self, body: &mut [u8], seal: &[u8]) -> Result<(), PeerError> {
        self.inner.open_payload(body, seal)
    }

    fn encrypted(&self) -> bool {
        self.inner.encrypted()
    }

    fn key_id(&self) -> Option<u64> {
        self.inner.key_id()
    }
}
