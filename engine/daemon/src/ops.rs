//! Operator commands over the client library: put, get, exists, stats, clear.

use anyhow::{Context, bail};
use kvnode_client::Client;
use kvnode_proto::client::PutStatus;

use crate::cli::{ClearArgs, GetArgs, KeyArgs, PutArgs, StatsArgs};
use crate::keys;

fn connect_ns(a: &KeyArgs) -> anyhow::Result<(Client, u32)> {
    let path = keys::socket(&a.socket);
    let mut c =
        Client::connect(&path).with_context(|| format!("connecting to {}", path.display()))?;
    let ns = c.register(&keys::spec(&a.ns)?)?.ns;
    Ok((c, ns))
}

pub fn put(a: &PutArgs) -> anyhow::Result<()> {
    let ks = keys::keys(&a.keys)?;
    let pb = keys::page_bytes(&a.keys.ns)? as usize;
    let blocks: Vec<Vec<u8>> = match (&a.file, a.seed) {
        (Some(f), _) => {
            let data = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
            let chunks: Vec<Vec<u8>> = data.chunks(pb).map(<[u8]>::to_vec).collect();
            if chunks.len() != ks.len() {
                bail!(
                    "{} holds {} chunks of --page-bytes {pb} but {} pages were named",
                    f.display(),
                    chunks.len(),
                    ks.len()
                );
            }
            chunks
        }
        (None, Some(seed)) => ks
            .iter()
            .map(|k| keys::seeded_bytes(seed, &k.0, pb))
            .collect(),
        (None, None) => bail!("give the bytes with --file FILE or --seed N"),
    };
    let (mut c, ns) = connect_ns(&a.keys)?;
    let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    let res = c.put_with_meta(ns, &ks, &refs, keys::metas(&a.keys, &ks))?;
    let stored = res.iter().filter(|r| **r == PutStatus::Stored).count();
    let existed = res.iter().filter(|r| **r == PutStatus::Exists).count();
    println!(
        "stored {stored} of {} pages ({existed} already present)",
        ks.len()
    );
    for (k, r) in ks.iter().zip(&res) {
        if !matches!(r, PutStatus::Stored | PutStatus::Exists) {
            println!("  {} {r:?}", k.0);
        }
    }
    if stored + existed != ks.len() {
        bail!("{} pages were not stored", ks.len() - stored - existed);
    }
    Ok(())
}

fn hint_text(h: &str) -> anyhow::Result<String> {
    match h.strip_prefix('@') {
        Some(f) => std::fs::read_to_string(f).with_context(|| format!("reading hint file {f}")),
        None => Ok(h.to_owned()),
    }
}

fn print_pull(r: &kvnode_proto::pull::OpReport) {
    println!(
        "pull op {}: {:?}, {} leading usable, peer {}, {:.2} ms{}",
        r.op,
        r.state,
        r.leading,
        r.peer.as_deref().unwrap_or("-"),
        r.elapsed_ms,
        r.reason
            .as_ref()
            .map(|f| format!(", reason: {f}"))
            .unwrap_or_default()
    );
    for (i, o) in r.results.iter().enumerate() {
        match o {
            kvnode_proto::pull::KeyOutcome::Failed(f) => println!("  key {i}: Failed {f}"),
            o => println!("  key {i}: {o:?}"),
        }
    }
}

pub fn get(a: &GetArgs) -> anyhow::Result<()> {
    let ks = keys::keys(&a.keys)?;
    let (mut c, ns) = connect_ns(&a.keys)?;
    let hint = a.hint.as_deref().map(hint_text).transpose()?;
    let hint = hint.as_deref();
    let pages: Vec<Option<Vec<u8>>> = if a.zero_copy {
        let (lease, pull) = c.get_lease_hinted(ns, &ks, hint, a.deadline_ms)?;
        if let Some(p) = &pull {
            print_pull(p);
        }
        let v = lease
            .extents
            .iter()
            .map(|e| e.map(|e| c.arena().read(e).to_vec()))
            .collect();
        if lease.id != 0 {
            c.release(lease.id)?;
        }
        v
    } else {
        let (pages, pull) = c.get_hinted(ns, &ks, hint, a.deadline_ms)?;
        if let Some(p) = &pull {
            print_pull(p);
        }
        pages
    };
    let lead = pages.iter().take_while(|p| p.is_some()).count();
    let total = pages.iter().filter(|p| p.is_some()).count();
    println!(
        "{lead} of {} leading pages hit ({total} found in all)",
        ks.len()
    );
    if let Some(out) = &a.out {
        let bytes: Vec<u8> = pages.into_iter().map_while(|p| p).flatten().collect();
        std::fs::write(out, &bytes).with_context(|| format!("writing {}", out.display()))?;
        println!("wrote {} bytes to {}", bytes.len(), out.display());
    }
    Ok(())
}

pub fn exists(a: &KeyArgs) -> anyhow::Result<()> {
    let ks = keys::keys(a)?;
    let (mut c, ns) = connect_ns(a)?;
    let n = c.exists(ns, &ks)?;
    println!("{n} of {} leading pages present", ks.len());
    Ok(())
}

pub fn stats(a: &StatsArgs) -> anyhow::Result<()> {
    let path = keys::socket(&a.socket);
    let mut c =
        Client::connect(&path).with_context(|| format!("connecting to {}", path.display()))?;
    let s = c.stats()?;
    let t = c.timeouts()?;
    if a.json {
        let v = serde_json::json!({ "stats": s, "timeouts": t });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", crate::stats_fmt::render(&s));
        print!("{}", crate::stats_fmt::render_timeouts(&t));
    }
    Ok(())
}

pub fn clear(a: &ClearArgs) -> anyhow::Result<()> {
    let path = keys::socket(&a.socket);
    let mut c =
        Client::connect(&path).with_context(|| format!("connecting to {}", path.display()))?;
    let ns = if a.all {
        None
    } else {
        Some(c.register(&keys::spec(&a.ns)?)?.ns)
    };
    let n = c.clear(ns)?;
    println!("cleared {n} blocks");
    Ok(())
}
