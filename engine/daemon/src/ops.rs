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
    // Register first: the daemon judges --page-bytes (bounded by its slab size) before
    // this process allocates a single page of it.
    let (mut c, ns) = connect_ns(&a.keys)?;
    let pb = usize::try_from(keys::page_bytes(&a.keys.ns)?).context("--page-bytes")?;
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
    let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
    let res = c.put_with_meta(ns, &ks, &refs, keys::metas(&a.keys, &ks))?;
    let summary = PutSummary::new(&ks, &res);
    print!("{}", summary.render(a.verbose));
    if summary.refused > 0 {
        bail!("{} pages were not stored", summary.refused);
    }
    Ok(())
}

/// Refused keys listed without `--verbose`.
const SHOWN_REFUSED: usize = 5;

/// What one `put` did, for the operator: totals, counts per refusal status, refused keys.
struct PutSummary {
    total: usize,
    stored: usize,
    existed: usize,
    refused: usize,
    by_status: std::collections::BTreeMap<String, usize>,
    refused_keys: Vec<(String, PutStatus)>,
}

impl PutSummary {
    fn new(ks: &[kvnode_proto::Key], res: &[PutStatus]) -> Self {
        let mut s = Self {
            total: ks.len(),
            stored: 0,
            existed: 0,
            refused: 0,
            by_status: std::collections::BTreeMap::new(),
            refused_keys: Vec::new(),
        };
        for (k, r) in ks.iter().zip(res) {
            match r {
                PutStatus::Stored => s.stored += 1,
                PutStatus::Exists => s.existed += 1,
                other => {
                    s.refused += 1;
                    *s.by_status.entry(format!("{other:?}")).or_default() += 1;
                    s.refused_keys.push((k.0.to_string(), *other));
                }
            }
        }
        s
    }

    fn render(&self, verbose: bool) -> String {
        use std::fmt::Write as _;
        let mut out = format!(
            "stored {} of {} pages ({} already present)\n",
            self.stored, self.total, self.existed
        );
        if self.refused == 0 {
            return out;
        }
        let counts: Vec<String> = self
            .by_status
            .iter()
            .map(|(st, n)| format!("{n} {st}"))
            .collect();
        let _ = writeln!(out, "refused {}: {}", self.refused, counts.join(", "));
        let shown = if verbose {
            self.refused_keys.len()
        } else {
            SHOWN_REFUSED.min(self.refused_keys.len())
        };
        for (k, st) in &self.refused_keys[..shown] {
            let _ = writeln!(out, "  {k} {st:?}");
        }
        if shown < self.refused_keys.len() {
            let _ = writeln!(
                out,
                "  ... and {} more (--verbose lists every refused page)",
                self.refused_keys.len() - shown
            );
        }
        out
    }
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
    let pages: Vec<Option<Vec<u8>>> = if a.zero_copy && hint.is_none() {
        // Split on `TooLarge`: each leading part is read and released before the next.
        let mut v = vec![None; ks.len()];
        c.get_lease_each(ns, &ks, |at, lease, arena| {
            for (j, e) in lease.extents.iter().enumerate() {
                v[at + j] = e.map(|e| arena.read(e).to_vec());
            }
        })?;
        v
    } else if a.zero_copy {
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
    if !a.all && a.ns.model.is_none() {
        bail!(
            "name what to clear: --model NAME (with the namespace's other flags) for one namespace, or --all for every namespace"
        );
    }
    let path = keys::socket(&a.socket);
    let mut c =
        Client::connect(&path).with_context(|| format!("connecting to {}", path.display()))?;
    let ns = if a.all {
        None
    } else {
        // Registering an unknown spec would create an empty namespace and "clear" it: name
        // the namespaces that do exist instead.
        let spec = keys::spec(&a.ns)?;
        let id = spec.id().to_string();
        let known = c.stats()?.namespaces;
        if !known.iter().any(|n| n.id == id) {
            let list: Vec<String> = known
                .iter()
                .map(|n| format!("{} ({} blocks)", n.model, n.blocks))
                .collect();
            bail!(
                "no namespace of model {:?} with these flags is registered on this daemon (registered: {}); check --page-size, --page-bytes, --dtype, --layout, --tp-*, --salt",
                spec.model,
                if list.is_empty() {
                    "none".to_owned()
                } else {
                    list.join(", ")
                }
            );
        }
        Some(c.register(&spec)?.ns)
    };
    let n = c.clear(ns)?;
    match &a.ns.model {
        Some(m) if !a.all => println!("cleared {n} blocks of model {m:?}"),
        _ => println!("cleared {n} blocks in all namespaces"),
    }
    Ok(())
}
