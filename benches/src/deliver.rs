//! Part of `kvnode bench pull`: a pulled prefix delivered into a client's memfd region (what
//! SGLang's HiCache backend asks for with a hinted `GetToRegion`), timed from the request to the
//! last page written, two ways in the same run:
//! - streamed: one hinted `GetToRegion`; the daemon copies each key into the region as soon as
//!   its block has landed, while later blocks are still on the wire;
//! - staged: a hinted `Get(Lease)` (the pull), then a local `GetToRegion` (the copy).
//!
//! The pull's own time (its report's `elapsed_ms`) is printed beside the streamed figure: the
//! difference is what delivery adds after the last block has landed.

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Instant;

use anyhow::{Context, bail, ensure};
use kvnode_client::Client;
use kvnode_proto::Key;
use kvnode_proto::pull::OpState;

/// Medians, in seconds.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    pub streamed: f64,
    pub streamed_pull: f64,
    pub staged: f64,
}

fn memfd(len: usize) -> anyhow::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name; the descriptor is ours.
    let raw = unsafe { libc::memfd_create(c"kvnode-bench-region".as_ptr(), libc::MFD_CLOEXEC) };
    ensure!(
        raw >= 0,
        "memfd_create: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    std::fs::File::from(fd.try_clone()?).set_len(len as u64)?;
    Ok(fd)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `iterations` deliveries of `keys` (pages of `page` bytes) each way, alternating; every key
/// is deleted on the destination after each, so each one is pulled again. `check` is the first
/// key's block, compared with what landed in the region.
pub fn measure(
    d: &mut Client,
    ns: u32,
    keys: &[Key],
    page: u64,
    hint: &str,
    iterations: usize,
    check: &[u8],
) -> anyhow::Result<Delivery> {
    let len = keys.len() * page as usize;
    let fd = memfd(len)?;
    let region = d.attach_region(fd.as_fd(), len as u64)?;
    let offs: Vec<u64> = (0..keys.len() as u64).map(|i| i * page).collect();
    let lens = vec![page; keys.len()];
    let (mut streamed, mut pulls, mut staged) = (Vec::new(), Vec::new(), Vec::new());
    let file = std::fs::File::from(fd.try_clone()?);
    for _ in 0..iterations.max(1) {
        let t = Instant::now();
        let (got, op) =
            d.get_to_region_hinted(ns, keys, region, &offs, &lens, hint, Some(30_000))?;
        streamed.push(t.elapsed().as_secs_f64());
        let op = op.context("no pull report")?;
        if op.state != OpState::Done || got.iter().any(Option::is_none) {
            bail!("streamed delivery incomplete: {op:?}");
        }
        pulls.push(op.elapsed_ms / 1e3);
        let mut first = vec![0u8; check.len()];
        file.read_exact_at(&mut first, 0)?;
        ensure!(
            first == check,
            "the region's first page is not the pulled block"
        );
        d.delete(ns, keys)?;

        let t = Instant::now();
        let (lease, op) = d.get_lease_hinted(ns, keys, Some(hint), Some(30_000))?;
        let op = op.context("no pull report")?;
        if op.state != OpState::Done || lease.leading_hits() != keys.len() {
            bail!("staged pull incomplete: {op:?}");
        }
        d.release(lease.id)?;
        let got = d.get_to_region(ns, keys, region, &offs, &lens)?;
        staged.push(t.elapsed().as_secs_f64());
        ensure!(got.iter().all(Option::is_some), "staged copy incomplete");
        d.delete(ns, keys)?;
    }
    d.detach_region(region)?;
    Ok(Delivery {
        streamed: median(streamed),
        streamed_pull: median(pulls),
        staged: median(staged),
    })
}
