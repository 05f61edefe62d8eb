//! Router metadata attached to `put`/`alloc` keys, turned into per-block [`RouterMeta`].
//!
//! Metadata lives outside the arena for as long as its block does (in DRAM or on NVMe), so
//! it is bounded three ways: a namespace's `page_size` (tokens per block) is at most
//! [`MAX_PAGE_SIZE`]; one request carries at most [`MAX_META_TOKENS_PER_REQUEST`] tokens
//! (else `Invalid`); and each tenant's live metadata is charged to its ledger, limited to
//! 1/[`META_SHARE`] of its DRAM allowance (its `dram_quota`, else the tier). A block whose
//! metadata does not fit is stored without it (not announced as a KV event) and counted in
//! `kvnode_meta_dropped_total`.
//!
//! [`MAX_PAGE_SIZE`]: kvnode_proto::namespace::MAX_PAGE_SIZE
//! [`META_SHARE`]: crate::residency::META_SHARE

use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::BlockMeta;

use crate::engine::Engine;
use crate::residency::RouterMeta;

/// Most metadata tokens one `Put`/`Alloc` may carry (4 MiB of token ids).
pub const MAX_META_TOKENS_PER_REQUEST: usize = 1 << 20;

/// Per-key router metadata, or an error text when the list does not match the keys or
/// carries too many tokens. Without events (or without metadata) every entry is `None`.
pub fn router_metas(
    engine: &Engine,
    ns: u32,
    keys: &[Key],
    meta: &[Option<BlockMeta>],
) -> Result<Vec<Option<Arc<RouterMeta>>>, String> {
    let store = &engine.store;
    if meta.is_empty() || !store.announces() {
        return Ok(vec![None; keys.len()]);
    }
    if meta.len() != keys.len() {
        return Err(format!(
            "{} keys but {} meta entries: give none or one per key",
            keys.len(),
            meta.len()
        ));
    }
    let tokens: usize = meta.iter().flatten().map(|m| m.tokens.len()).sum();
    if tokens > MAX_META_TOKENS_PER_REQUEST {
        return Err(format!(
            "{tokens} metadata tokens in one request; at most {MAX_META_TOKENS_PER_REQUEST}: split the request"
        ));
    }
    let Some(budget) = store.meta_budget(ns) else {
        // The reservation reports the unknown namespace.
        return Ok(vec![None; keys.len()]);
    };
    let mut dropped = 0u64;
    let out = keys
        .iter()
        .zip(meta)
        .map(|(k, m)| {
            let charge = |bytes| {
                let c = budget.charge(bytes);
                dropped += u64::from(c.is_none());
                c
            };
            RouterMeta::from_client(&budget.spec, k.0.router_hash(), m.as_ref(), charge)
        })
        .collect();
    if dropped > 0 {
        engine.metrics.meta_dropped(dropped);
        tracing::debug!(tenant = %budget.tenant, blocks = dropped, limit = budget.limit(), "router metadata budget full; blocks stored without KV events");
    }
    Ok(out)
}
