//! One engine rank of the live replay: its GPU prefix cache, and a client of its cache's
//! daemon. A request is served as an engine with a KV connector serves it: the leading blocks
//! in GPU memory, then one get of the rest from the daemon (with the router's hint, the
//! daemon first pulls what the hinted node holds and it lacks), every block read back checked
//! against its id, the rest recomputed and offloaded after the prefill.

use std::time::Instant;

use anyhow::{Context, ensure};
use kvnode_client::Client;
use kvnode_proto::client::PutStatus;
use kvnode_proto::pull::KeyOutcome;
use kvnode_proto::{Key, NamespaceSpec};

use super::blocks::{self, GpuCache, PAGE_TOKENS};
use super::cost::CostModel;
pub use super::cost::Served;
use super::trace::Request;

/// Wall time of the daemon calls of one request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timing {
    /// Seconds in the get (and its pull, if hinted): the daemon call alone, not the check of
    /// the bytes read back.
    pub get_s: f64,
    /// Whether the get pulled.
    pub pulled: bool,
    /// Seconds in the offload puts.
    pub put_s: f64,
    /// Seconds from the request's arrival (its trace time, sped up) until its engine took it
    /// (timed mode; the router's wait for a free slot included).
    pub queue_s: f64,
    /// Seconds from its placement (the router's prefetch, if any, sent) until its engine
    /// took it: the time a prefetch at placement had before the get.
    pub placed_s: f64,
    /// Seconds the engine held it for its modelled prefill (`--hold-prefill`).
    pub hold_s: f64,
    /// The router started a `kv.prefetch` for it at placement.
    pub prefetched: bool,
}

/// `--hold-prefill`: an engine holds each request for its modelled prefill / speedup.
#[derive(Clone, Copy, Debug)]
pub struct Hold {
    /// The prefill model.
    pub cost: CostModel,
    /// The replay's speedup.
    pub speedup: f64,
}

/// A `kv.fetch` hint: the peer's endpoint and the leading blocks the router thinks it holds.
#[derive(Clone, Debug)]
pub struct Hint {
    /// `tcp://host:port` of the peer daemon.
    pub endpoint: String,
    /// Leading blocks of the request it holds.
    pub blocks: usize,
}

/// The namespace every engine and daemon of the replay uses.
pub fn spec(block: u64) -> NamespaceSpec {
    NamespaceSpec {
        model: "kvnode-replay".into(),
        page_size: PAGE_TOKENS,
        segments: vec![block],
        ..NamespaceSpec::default()
    }
}

/// An engine rank.
#[derive(Debug)]
pub struct Engine {
    /// GPU prefix cache.
    pub gpu: GpuCache,
    conn: Option<(Client, u32)>,
    block: usize,
    hold: Option<Hold>,
    /// Touch the GPU-cache hits of each request in the node's tier before its get.
    touch: bool,
}

impl Engine {
    /// An engine with `gpu_blocks` of GPU cache, a client of the daemon at `sock` if any,
    /// holding each request for its modelled prefill with `hold`.
    pub fn new(
        gpu_blocks: usize,
        sock: Option<&std::path::Path>,
        block: u64,
        hold: Option<Hold>,
    ) -> anyhow::Result<Self> {
        let conn = sock
            .map(|s| -> anyhow::Result<(Client, u32)> {
                let mut c = Client::connect(s).context("engine connecting to its daemon")?;
                let ns = c.register(&spec(block))?.ns;
                Ok((c, ns))
            })
            .transpose()?;
        Ok(Self {
            gpu: GpuCache::new(gpu_blocks),
            conn,
            block: block as usize,
            hold,
            touch: false,
        })
    }

    /// Whether it touches its GPU-cache hits in its node's tier (`Touch`) before each get,
    /// as an engine integration does for pages its GPU prefix cache served.
    #[must_use]
    pub fn touching_gpu_hits(mut self, on: bool) -> Self {
        self.touch = on;
        self
    }

    /// Serves `r`.
    pub fn serve(&mut self, r: &Request, hint: Option<&Hint>) -> anyhow::Result<(Served, Timing)> {
        let g = self.gpu.leading(&r.blocks);
        let mut s = Served {
            refs: r.blocks.len() as u64,
            gpu: g as u64,
            ..Served::default()
        };
        let mut t = Timing::default();
        let rest = &r.blocks[g..];
        if let Some((c, ns)) = self.conn.as_mut()
            && !rest.is_empty()
        {
            if self.touch && g > 0 {
                let hits: Vec<Key> = r.blocks[..g].iter().map(|&b| blocks::key(b)).collect();
                c.touch(*ns, &hits)?;
            }
            let keys: Vec<Key> = rest.iter().map(|&b| blocks::key(b)).collect();
            let hint = hint
                .filter(|h| h.blocks > g)
                .map(|h| hint_json(h, &r.blocks));
            let (lead, get_s) = get(c, *ns, &keys, rest, hint.as_deref(), &mut s, self.block)?;
            t.get_s = get_s;
            t.pulled = hint.is_some();
            s.computed = s.refs - s.gpu - s.dram - s.peer;
            t.hold_s = hold(self.hold, r, &s);
            let t1 = Instant::now();
            s.stored = offload(c, *ns, &r.blocks, g + lead, self.block)?;
            t.put_s = t1.elapsed().as_secs_f64();
        } else {
            s.computed = s.refs - s.gpu - s.dram - s.peer;
            t.hold_s = hold(self.hold, r, &s);
        }
        self.gpu.admit(&r.blocks);
        Ok((s, t))
    }
}

/// Sleeps for `r`'s modelled prefill divided by the speedup (the engine busy computing the
/// tokens it was not served); returns the seconds held.
fn hold(h: Option<Hold>, r: &Request, s: &Served) -> f64 {
    let Some(h) = h else { return 0.0 };
    let d = std::time::Duration::from_secs_f64(h.cost.prefill_ms(r, s) / 1e3 / h.speedup);
    let t = Instant::now();
    std::thread::sleep(d);
    t.elapsed().as_secs_f64()
}

fn hint_json(h: &Hint, blocks: &[u64]) -> String {
    serde_json::json!({
        "source_control_endpoint": h.endpoint,
        "block_hashes": &blocks[..h.blocks],
    })
    .to_string()
}

/// The get: counts the leading run by source and checks every block's bytes; returns the
/// leading run's length and the seconds the daemon call took (the check not included: it
/// costs the replay, at its block size, what no engine pays).
fn get(
    c: &mut Client,
    ns: u32,
    keys: &[Key],
    ids: &[u64],
    hint: Option<&str>,
    s: &mut Served,
    block: usize,
) -> anyhow::Result<(usize, f64)> {
    let t0 = Instant::now();
    let (lease, op) = c.get_lease_hinted(ns, keys, hint, Some(30_000))?;
    let secs = t0.elapsed().as_secs_f64();
    let lead = lease.leading_hits();
    for (i, e) in lease.extents.iter().enumerate() {
        let Some(e) = e else { continue };
        let want = blocks::content(ids[i], block);
        ensure!(
            c.arena().read(*e) == want.as_slice(),
            "block {} read back from the daemon differs from what was stored",
            ids[i]
        );
    }
    for i in 0..lead {
        let pulled = op
            .as_ref()
            .is_some_and(|o| o.results.get(i) == Some(&KeyOutcome::Pulled));
        if pulled {
            s.peer += 1;
        } else {
            s.dram += 1;
        }
    }
    if lease.id != 0 {
        c.release(lease.id)?;
    }
    Ok((lead, secs))
}

/// Offloads `blocks[from..]` (recomputed) with their router metadata; returns how many the
/// daemon stored (the others it held already).
fn offload(
    c: &mut Client,
    ns: u32,
    blocks: &[u64],
    from: usize,
    block: usize,
) -> anyhow::Result<u64> {
    let mut stored = 0;
    let ids: Vec<usize> = (from..blocks.len()).collect();
    for part in ids.chunks(super::tier::PUT_KEYS) {
        let keys: Vec<Key> = part.iter().map(|&i| blocks::key(blocks[i])).collect();
        let bytes: Vec<Vec<u8>> = part
            .iter()
            .map(|&i| blocks::content(blocks[i], block))
            .collect();
        let refs: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        let meta = part
            .iter()
            .map(|&i| Some(blocks::meta(blocks[i], i.checked_sub(1).map(|p| blocks[p]))))
            .collect();
        for st in c.put_with_meta(ns, &keys, &refs, meta)? {
            match st {
                PutStatus::Stored => stored += 1,
                PutStatus::Exists => {}
                other => anyhow::bail!("offload refused: {other:?}"),
            }
        }
    }
    Ok(stored)
}
