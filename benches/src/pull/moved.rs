//! How the destination moved the blocks of the measured pulls, by its own counters
//! (`stats.peer`: `peer_ucx_gets_total`, `peer_ucx_fallbacks_total`), not by the log line a
//! connection writes when it is set up (a connection can say UCX and still pull over TCP).
//! With `--transport ucx` the run fails unless every block of the measured pulls was read
//! by a UCX GET and no connection fell back to TCP.

use anyhow::bail;
use kvnode_client::Client;

/// The destination's UCX counters, summed over its peers.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Counters {
    gets: u64,
    fallbacks: u64,
}

impl Counters {
    /// Reads them from the destination's stats.
    pub(super) fn read(d: &mut Client) -> anyhow::Result<Self> {
        let s = d.stats()?;
        Ok(s.peer.iter().fold(Self::default(), |c, p| Self {
            gets: c.gets + p.peer_ucx_gets_total,
            fallbacks: c.fallbacks + p.peer_ucx_fallbacks_total,
        }))
    }
}

/// Blocks of the measured pulls, how many of them came by UCX GET, and the destination's
/// fallbacks to TCP over the whole run.
#[derive(Clone, Copy, Debug)]
pub(super) struct Moved {
    pub(super) blocks: u64,
    pub(super) gets: u64,
    pub(super) fallbacks: u64,
}

impl Moved {
    /// What moved between `before` and `after`, which bracket pulls of `blocks` blocks.
    pub(super) fn between(before: Counters, after: Counters, blocks: u64) -> Self {
        Self {
            blocks,
            gets: after.gets - before.gets,
            fallbacks: after.fallbacks,
        }
    }

    /// `UCX GETs`, `TCP`, or `mixed` when only some blocks came by GET.
    pub(super) fn by(&self) -> &'static str {
        match self.gets {
            0 => "TCP",
            g if g == self.blocks && self.fallbacks == 0 => "UCX GETs",
            _ => "mixed",
        }
    }

    /// Prints the line; with `--transport ucx`, fails unless every block came by GET.
    pub(super) fn check(&self, transport: &str) -> anyhow::Result<()> {
        println!(
            "blocks moved by: {} ({} of the {} blocks of the measured pulls read by UCX GET, {} connections fell back to TCP; destination stats.peer)",
            self.by(),
            self.gets,
            self.blocks,
            self.fallbacks
        );
        if transport == "ucx" && self.by() != "UCX GETs" {
            bail!(
                "--transport ucx, but the destination's counters show {} of the {} blocks of the measured pulls read by UCX GET and {} connections fallen back to TCP: these figures are not UCX's (see the daemons' logs for why UCX was not used)",
                self.gets,
                self.blocks,
                self.fallbacks
            );
        }
        Ok(())
    }
}
