//! Drives the live replay of one arm: engines as threads with bounded requests in flight,
//! requests released at the trace's timestamps (sped up) and placed by the router over the
//! KV-event index; or, deterministic, one request at a time with the router's view synced to
//! every daemon's published events before each placement.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvnode_client::Client;

use super::config::{Arm, PrefetchAt, Setup};
use super::engine::{Engine, Hint, Hold, Served, Timing};
use super::events::{Subscribers, View};
use super::fleet::Daemon;
use super::prefetch::Prefetcher;
use super::router::Router;
use super::trace::Request;

/// What happened to one request.
#[derive(Clone, Copy, Debug)]
pub struct Record {
    /// Engine that served it.
    pub engine: usize,
    /// Where its blocks came from.
    pub served: Served,
    /// Wall time of its daemon calls.
    pub timing: Timing,
}

/// The live fleet of one arm.
#[derive(Debug)]
pub struct Live<'a> {
    /// Setup.
    pub setup: &'a Setup,
    /// Arm.
    pub arm: Arm,
    /// Its daemons.
    pub daemons: &'a [Daemon],
    /// The router's view.
    pub subs: &'a Subscribers,
    /// When the pulls arm starts a hinted pull.
    pub prefetch_at: PrefetchAt,
    /// Engines hold each request for its modelled prefill (`--hold-prefill`).
    pub hold: Option<Hold>,
}

/// A request on its way to an engine: its index, itself, its hint, when it arrived and when
/// it was placed, and whether the router started its prefetch.
type Job = (usize, Request, Option<Hint>, [Instant; 2], bool);

impl Live<'_> {
    fn engine(&self, e: usize) -> anyhow::Result<Engine> {
        let sock = self
            .setup
            .cache_of(self.arm, e)
            .map(|c| self.daemons[c].sock.as_path());
        Engine::new(
            self.setup.gpu_blocks,
            sock,
            self.setup.block_bytes,
            self.hold,
        )
        .map(|en| en.touching_gpu_hits(self.setup.touch_gpu_hits))
    }

    /// The router's side of the daemons' router entries, with `--prefetch-at placement` in
    /// the pulls arm.
    fn prefetcher(&self) -> anyhow::Result<Option<Prefetcher>> {
        if self.arm != Arm::Pulls || self.prefetch_at != PrefetchAt::Placement {
            return Ok(None);
        }
        let entries = self
            .daemons
            .iter()
            .map(|d| d.router.clone())
            .collect::<Option<Vec<_>>>()
            .context("--prefetch-at placement needs at least 2 nodes (a router entry on each)")?;
        Ok(Some(Prefetcher::new(entries, self.setup.block_bytes)))
    }

    /// At placement: starts the pull `hint` names into engine `e`'s daemon, if prefetching.
    fn prefetch(
        &self,
        p: Option<&mut Prefetcher>,
        e: usize,
        r: &Request,
        hint: Option<&Hint>,
    ) -> anyhow::Result<bool> {
        match (p, hint, self.setup.cache_of(self.arm, e)) {
            (Some(p), Some(h), Some(c)) => p.start(c, &r.blocks, h),
            _ => Ok(false),
        }
    }

    fn router(&self) -> Router {
        let cache_of = (0..self.setup.engines())
            .map(|e| self.setup.cache_of(self.arm, e))
            .collect();
        Router::new(self.setup, cache_of, self.arm == Arm::Pulls)
    }

    fn hint(&self, source: Option<(usize, usize)>) -> Option<Hint> {
        source.and_then(|(c, blocks)| {
            self.daemons[c]
                .peer
                .clone()
                .map(|endpoint| Hint { endpoint, blocks })
        })
    }

    /// One request at a time, in trace order; before each placement the router's view has
    /// every event each daemon published.
    pub fn deterministic(&self, trace: &[Request]) -> anyhow::Result<Vec<Record>> {
        let mut engines: Vec<Engine> = (0..self.setup.engines())
            .map(|e| self.engine(e))
            .collect::<anyhow::Result<_>>()?;
        let mut admin: Vec<Client> = self
            .daemons
            .iter()
            .map(|d| Client::connect(&d.sock))
            .collect::<Result<_, _>>()?;
        let mut router = self.router();
        let mut pf = self.prefetcher()?;
        let idle = vec![0; engines.len()];
        let mut out = Vec::with_capacity(trace.len());
        for r in trace {
            sync(&mut admin, &self.subs.view)?;
            let d = {
                let ix = self.subs.view.index.lock().expect("index lock");
                router.place(&r.blocks, &ix, &idle)
            };
            let hint = self.hint(d.source);
            let prefetched = self.prefetch(pf.as_mut(), d.engine, r, hint.as_ref())?;
            let (served, mut timing) = engines[d.engine].serve(r, hint.as_ref())?;
            timing.prefetched = prefetched;
            out.push(Record {
                engine: d.engine,
                served,
                timing,
            });
        }
        if let Some(p) = &pf {
            println!("{p}");
        }
        Ok(out)
    }

    /// The trace's timestamps divided by `speedup`, at most `in_flight` requests per engine.
    pub fn timed(
        &self,
        trace: &[Request],
        speedup: f64,
        in_flight: usize,
    ) -> anyhow::Result<Vec<Record>> {
        let n = self.setup.engines();
        let load: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
        let (done_tx, done_rx) = mpsc::channel::<anyhow::Result<(usize, Record)>>();
        let mut senders = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for e in 0..n {
            let (tx, rx) = mpsc::channel::<Job>();
            senders.push(tx);
            let mut engine = self.engine(e)?;
            let (done, load) = (done_tx.clone(), Arc::clone(&load));
            threads.push(std::thread::spawn(move || {
                for (i, r, hint, [arrived, placed], prefetched) in rx {
                    let queue_s = arrived.elapsed().as_secs_f64();
                    let placed_s = placed.elapsed().as_secs_f64();
                    let res = engine.serve(&r, hint.as_ref()).map(|(served, mut timing)| {
                        timing.queue_s = queue_s;
                        timing.placed_s = placed_s;
                        timing.prefetched = prefetched;
                        let rec = Record {
                            engine: e,
                            served,
                            timing,
                        };
                        (i, rec)
                    });
                    load[e].fetch_sub(1, Ordering::Relaxed);
                    let failed = res.is_err();
                    let _ = done.send(res);
                    if failed {
                        return;
                    }
                }
            }));
        }
        drop(done_tx);
        let mut router = self.router();
        let mut pf = self.prefetcher()?;
        let t0 = Instant::now();
        for (i, r) in trace.iter().enumerate() {
            let due = Duration::from_secs_f64(r.at_ms as f64 / 1e3 / speedup);
            if let Some(wait) = due.checked_sub(t0.elapsed()) {
                std::thread::sleep(wait);
            }
            let arrived = t0 + due;
            let now: Vec<usize> = load.iter().map(|l| l.load(Ordering::Relaxed)).collect();
            let d = {
                let ix = self.subs.view.index.lock().expect("index lock");
                router.place(&r.blocks, &ix, &now)
            };
            let hint = self.hint(d.source);
            let placed = Instant::now();
            let prefetched = self.prefetch(pf.as_mut(), d.engine, r, hint.as_ref())?;
            while load[d.engine].load(Ordering::Relaxed) >= in_flight.max(1) {
                std::thread::sleep(Duration::from_micros(200));
            }
            load[d.engine].fetch_add(1, Ordering::Relaxed);
            senders[d.engine]
                .send((i, r.clone(), hint, [arrived, placed], prefetched))
                .context("an engine stopped")?;
        }
        drop(senders);
        if let Some(p) = &pf {
            println!("{p}");
        }
        let mut out: Vec<Option<Record>> = vec![None; trace.len()];
        for res in done_rx {
            let (i, rec) = res?;
            out[i] = Some(rec);
        }
        for t in threads {
            let _ = t.join();
        }
        out.into_iter()
            .map(|r| r.context("a request was not served"))
            .collect()
    }
}

/// Waits until the subscribers have every event each daemon has published (none queued).
fn sync(admin: &mut [Client], view: &View) -> anyhow::Result<()> {
    let t = Instant::now();
    for (c, a) in admin.iter_mut().enumerate() {
        loop {
            let ev = a.stats()?.events.unwrap_or_default();
            if ev.queued_bytes == 0 && view.seen[c].load(Ordering::Relaxed) >= ev.published {
                break;
            }
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(10),
                "the router's subscriber missed KV events of daemon {c}: {} seen, {} published",
                view.seen[c].load(Ordering::Relaxed),
                ev.published
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(())
}
