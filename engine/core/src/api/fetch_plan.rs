//! `Exists`, and with a recompute cost its fetch plan (docs/fetch-plans.md): which leading
//! keys are worth fetching from where, given the live cost model's figures. A hint's pull
//! starts only when the plan takes the peer; a peer that loses is not dialled.

use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::Reply;
use kvnode_proto::plan::{FetchPlan, PlanReason, PlanSource, ReadPath, RecomputeCost};

use super::errors::{invalid, tier_error};
use super::session::Session;
use crate::obs::cost::{DRAM_COPY, DRAM_GPU, DRAM_REGION, NVME_READ};
use crate::plan::{Avail, Figures, Probing, plan};
use crate::store::Location;

/// What a hint adds to the keys this node holds: the peer's name and the keys it covers.
struct Hinted {
    peer: String,
    covered: usize,
}

impl Session {
    /// `Exists`: the leading keys held now; with `hint`, a background pull; with
    /// `recompute`, the fetch plan (and the pull only when the plan takes the peer).
    pub(super) async fn exists_op(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
        recompute: Option<RecomputeCost>,
    ) -> Reply {
        let store = Arc::clone(&self.engine.store);
        let count = match store.exists(ns, keys) {
            Ok(c) => c,
            Err(e) => return tier_error(&e),
        };
        let Some(cost) = recompute else {
            let pull = match hint {
                Some(h) => Some(Box::new(self.exists_pull(ns, keys, h).await)),
                None => None,
            };
            return Reply::Exists {
                count,
                pull,
                plan: None,
            };
        };
        if let Err(e) = cost.validate() {
            return invalid(e.to_string());
        }
        let hinted = hint.and_then(|h| {
            let (peer, covered) = self.engine.peers.preview(h, keys).ok()?;
            Some(Hinted { peer, covered })
        });
        let plan = match self.plan_for(ns, keys, &cost, hinted.as_ref()) {
            Ok(p) => p,
            Err(reply) => return reply,
        };
        let takes_peer = plan.runs.iter().any(|r| r.source == PlanSource::Peer);
        let pull = match (hint, &hinted) {
            (Some(h), Some(_)) if takes_peer => {
                let planned = &keys[..plan.keys as usize];
                Some(Box::new(self.exists_pull(ns, planned, h).await))
            }
            (Some(h), Some(_)) => {
                // The envelope's other actions still run; only the pull is left out.
                let _ = self.side_actions(ns, keys, Some(h)).await;
                self.engine.metrics.plans.pull_skipped();
                None
            }
            // A hint refused (it is reported as before, and dials nothing) or none.
            (Some(h), None) => Some(Box::new(self.exists_pull(ns, keys, h).await)),
            (None, _) => None,
        };
        Reply::Exists {
            count,
            pull,
            plan: Some(Box::new(plan)),
        }
    }

    /// The plan over what this node holds (the leading run) and what `hinted` adds.
    fn plan_for(
        &self,
        ns: u32,
        keys: &[Key],
        cost: &RecomputeCost,
        hinted: Option<&Hinted>,
    ) -> Result<FetchPlan, Reply> {
        let store = &self.engine.store;
        let held = store.held(ns, keys).map_err(|e| tier_error(&e))?;
        let avail_of = |(at, bytes): (Location, u64)| match at {
            Location::Dram => Some(Avail {
                source: PlanSource::Dram,
                bytes,
            }),
            Location::Nvme => Some(Avail {
                source: PlanSource::Nvme,
                bytes,
            }),
            Location::Absent => None,
        };
        let mut avail: Vec<Avail> = held.iter().map_while(|&h| avail_of(h)).collect();
        let mut peer_keys = 0;
        if let Some(h) = hinted.filter(|h| h.covered > avail.len()) {
            let spec = store
                .dram()
                .namespace_spec(ns)
                .map_err(|e| tier_error(&e))?;
            for (k, &at) in keys[avail.len()..h.covered]
                .iter()
                .zip(&held[avail.len()..])
            {
                avail.push(avail_of(at).unwrap_or_else(|| {
                    peer_keys += 1;
                    Avail {
                        source: PlanSource::Peer,
                        bytes: spec.segments.get(usize::from(k.1)).copied().unwrap_or(0),
                    }
                }));
            }
        }
        let costs = &self.engine.metrics.costs;
        let figures = Figures {
            read: costs.figure(match cost.via {
                ReadPath::Copy => DRAM_COPY,
                ReadPath::Region => DRAM_REGION,
                ReadPath::Gpu => DRAM_GPU,
            }),
            nvme: costs.figure(NVME_READ),
            peer: hinted
                .and_then(|h| costs.peer_figure(&h.peer, self.engine.peers.stripes(peer_keys))),
        };
        let c = &self.engine.config.plans;
        let probing = Probing {
            probe_bytes: c.probe_bytes,
            probe_s: c.probe_ms / 1e3,
            reprobe_s: c.reprobe_s,
            margin: c.margin,
        };
        let p = plan(&avail, cost, &figures, &probing);
        self.engine.metrics.plans.count(&p);
        let reason = match p.reason {
            PlanReason::All => 0,
            PlanReason::Slower => 1,
            PlanReason::Probe => 2,
            PlanReason::Nothing => 3,
        };
        let us = |s: f64| (s * 1e6) as u64;
        crate::probes::plan(
            self.id,
            ns,
            p.available,
            p.keys,
            reason,
            us(p.fetch_s),
            us(p.recompute_s),
        );
        tracing::debug!(conn = self.id, ns, keys = p.keys, available = p.available,
            reason = ?p.reason, note = %p.note, "fetch plan");
        Ok(p)
    }
}
