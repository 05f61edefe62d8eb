//! Namespace and key arguments to protocol values; deterministic page bytes.

use anyhow::{Context, bail};
use kvnode_proto::client::BlockMeta;
use kvnode_proto::hash::{page_digests, sglang_namespace_seed};
use kvnode_proto::size::parse_size;
use kvnode_proto::{Digest, Key, NamespaceSpec};

use crate::cli::{KeyArgs, NsArgs, SocketArg};

/// Model name of the namespace when `--model` is not given (put, get, exists).
pub const DEFAULT_MODEL: &str = "default";

/// The socket path in force.
pub fn socket(s: &SocketArg) -> std::path::PathBuf {
    s.socket
        .clone()
        .unwrap_or_else(kvnode_engine::config::default_socket)
}

/// The namespace spec named by the flags.
pub fn spec(a: &NsArgs) -> anyhow::Result<NamespaceSpec> {
    Ok(NamespaceSpec {
        model: a.model.clone().unwrap_or_else(|| DEFAULT_MODEL.to_owned()),
        dtype: a.dtype.clone(),
        page_size: a.page_size,
        layout: a.layout.clone(),
        tp_rank: a.tp_rank,
        tp_size: a.tp_size,
        tenant_salt: a.salt.clone(),
        segments: vec![page_bytes(a)?],
        ..NamespaceSpec::default()
    })
}

/// Bytes per page.
pub fn page_bytes(a: &NsArgs) -> anyhow::Result<u64> {
    parse_size(&a.page_bytes).context("--page-bytes")
}

/// Keys named by `--keys` or `--tokens`.
pub fn keys(a: &KeyArgs) -> anyhow::Result<Vec<Key>> {
    if !a.keys.is_empty() {
        return a
            .keys
            .iter()
            .map(|h| {
                Digest::from_hex(h)
                    .map(Key::page)
                    .with_context(|| format!("key {h:?}"))
            })
            .collect();
    }
    if a.tokens.is_empty() {
        bail!("give pages as --keys HEX,... or --tokens 1,2,3,...");
    }
    let ps = a.ns.page_size as usize;
    if ps == 0 {
        bail!("--page-size must be at least 1");
    }
    if a.tokens.len() < ps {
        bail!("{} tokens make no full page of {ps} tokens", a.tokens.len());
    }
    let seed = sglang_namespace_seed(a.extra_key.as_deref(), a.cache_salt.as_deref());
    Ok(page_digests(&a.tokens, ps, seed)
        .into_iter()
        .map(Key::page)
        .collect())
}

/// Router metadata for `--tokens` pages (their tokens and parent digest); empty for `--keys`.
pub fn metas(a: &KeyArgs, keys: &[Key]) -> Vec<Option<BlockMeta>> {
    if a.tokens.is_empty() {
        return Vec::new();
    }
    let ps = a.ns.page_size as usize;
    keys.iter()
        .enumerate()
        .map(|(i, _)| {
            Some(BlockMeta {
                tokens: a.tokens[i * ps..(i + 1) * ps].to_vec(),
                parent: i.checked_sub(1).map(|p| keys[p].0),
            })
        })
        .collect()
}

pub use kvnode_client::seeded::bytes as seeded_bytes;
