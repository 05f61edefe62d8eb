//! Router metadata attached to `put`/`alloc` keys, turned into per-block [`RouterMeta`].

use std::sync::Arc;

use kvnode_proto::Key;
use kvnode_proto::client::BlockMeta;

use crate::residency::RouterMeta;
use crate::store::Store;

/// Per-key router metadata, or an error text when the list does not match the keys.
/// Without events (or without metadata) every entry is `None`.
pub fn router_metas(
    store: &Store,
    ns: u32,
    keys: &[Key],
    meta: &[Option<BlockMeta>],
) -> Result<Vec<Option<Arc<RouterMeta>>>, String> {
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
    let Ok(spec) = store.namespace_spec(ns) else {
        // The reservation reports the unknown namespace.
        return Ok(vec![None; keys.len()]);
    };
    Ok(keys
        .iter()
        .zip(meta)
        .map(|(k, m)| RouterMeta::from_client(&spec, k.0.router_hash(), m.as_ref()))
        .collect())
}
