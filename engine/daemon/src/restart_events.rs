//! The KV event stream across a stop and a start on the same spill directory (issue 42,
//! item 4; docs/events.md "Restart: the stream continues").
//!
//! ```text
//!  SIGTERM ─> drain ─> stop-time flush (DRAM blocks copied to NVMe)
//!          ─> Announcer::hand_over: every residency silenced (the exit removes nothing),
//!             the seq of the next batch, the blocks announced in DRAM and on NVMe
//!          ─> <first spill dir>/kvnode-events.continue (0600, written whole, then renamed)
//!  start   ─> read it (ours, not writable by others), delete it
//!          ─> the publisher continues at that seq; blocks announced on NVMe that the spill
//!             tier holds are adopted as announced (nothing published); a block announced
//!             in DRAM that the flush copied down is announced on NVMe, then its DRAM copy
//!             removed (a tier move, which is what happened); the rest are removed
//! ```
//!
//! Without the file (a SIGKILL, a crash, events off, an older build) the daemon starts a
//! new stream, as before. The file holds token ids of every published tenant: it lives in
//! the spill directory (the daemon's own) with mode 0600, and one that another uid owns or
//! that others may write is refused and removed.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::Arc;

use kvnode_engine::EngineConfig;
use kvnode_engine::dram::image::{decode_announced, encode_announced};
use kvnode_engine::residency::{HandedOver, RouterMeta};
use kvnode_proto::BlockKey;

const FILE: &str = "kvnode-events.continue";
const MAGIC: &str = "kvnode events continue 1";

/// Where a stopped daemon's successor on the same spill directory continues the stream.
#[derive(Debug, Default)]
pub struct Continuation {
    /// The seq of the first batch.
    pub seq: u64,
    /// Blocks announced on NVMe, with their metadata.
    pub nvme: Vec<(BlockKey, RouterMeta)>,
    /// Blocks announced in DRAM, with their metadata.
    pub dram: Vec<(BlockKey, RouterMeta)>,
}

fn path_of(cfg: &EngineConfig) -> Option<PathBuf> {
    cfg.events.endpoint.as_ref()?;
    Some(cfg.spill.dirs.first()?.path.join(FILE))
}

fn encode(endpoint: &str, h: &HandedOver) -> Vec<u8> {
    let nvme = encode_announced(&h.nvme);
    let dram = encode_announced(&h.dram);
    let mut out = format!(
        "{MAGIC}\nendpoint {endpoint}\nseq {}\nnvme {}\ndram {}\n",
        h.seq,
        nvme.len(),
        dram.len()
    )
    .into_bytes();
    out.extend_from_slice(&nvme);
    out.extend_from_slice(&dram);
    out
}

/// The continuation in `bytes` for a daemon publishing on `endpoint`; why not otherwise.
fn decode(bytes: &[u8], endpoint: &str) -> Result<Continuation, String> {
    let mut at = 0;
    let mut line = |key: &str| -> Result<String, String> {
        let end = bytes[at..]
            .iter()
            .position(|&c| c == b'\n')
            .ok_or("truncated")?;
        let text = std::str::from_utf8(&bytes[at..at + end]).map_err(|_| "not text")?;
        at += end + 1;
        let value = if key.is_empty() {
            (text == MAGIC).then(String::new)
        } else {
            text.strip_prefix(key).map(str::to_owned)
        };
        value.ok_or_else(|| format!("expected `{key}`, found `{text}`"))
    };
    line("")?;
    let ep = line("endpoint ")?;
    if ep != endpoint {
        return Err(format!(
            "it continues the stream on {ep}, this daemon publishes on {endpoint}"
        ));
    }
    let num = |s: String| s.parse::<u64>().map_err(|e| format!("`{s}`: {e}"));
    let seq = num(line("seq ")?)?;
    let nvme_len = usize::try_from(num(line("nvme ")?)?).map_err(|e| e.to_string())?;
    let dram_len = usize::try_from(num(line("dram ")?)?).map_err(|e| e.to_string())?;
    let body = |from: usize, len: usize| {
        let b = bytes
            .get(from..from.checked_add(len).ok_or("length overflows")?)
            .ok_or("truncated")?;
        decode_announced(b).map_err(|e| e.to_string())
    };
    let nvme = body(at, nvme_len)?;
    let dram = body(at + nvme_len, dram_len)?;
    if at + nvme_len + dram_len != bytes.len() {
        return Err("bytes after the lists".into());
    }
    Ok(Continuation { seq, nvme, dram })
}

/// After the stop-time flush: silences every residency and writes where the next daemon on
/// this spill directory continues the stream. Nothing without events or a spill directory.
pub async fn save(engine: &kvnode_engine::Engine) {
    let Some(path) = path_of(&engine.config) else {
        return;
    };
    let endpoint = engine.config.events.endpoint.clone().unwrap_or_default();
    let Some(h) = engine
        .store
        .announcer()
        .hand_over(std::time::Duration::from_secs(5), true)
        .await
    else {
        return;
    };
    let bytes = encode(&endpoint, &h);
    let tmp = path.with_extension("tmp");
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    match written {
        Ok(()) => tracing::info!(
            seq = h.seq,
            nvme = h.nvme.len(),
            dram = h.dram.len(),
            path = %path.display(),
            "KV events: the next daemon on this spill directory continues the stream"
        ),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(error = %e, path = %path.display(), "cannot write the KV event continuation: the next daemon starts a new stream");
        }
    }
}

/// At start (not a takeover): the continuation a stopped predecessor left, if any, removed
/// once read (it is used once).
pub fn load(cfg: &EngineConfig) -> Option<Continuation> {
    let path = path_of(cfg)?;
    let meta = std::fs::symlink_metadata(&path).ok()?;
    let read = || -> Result<Continuation, String> {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.file_type().is_file() || meta.uid() != me || meta.permissions().mode() & 0o022 != 0
        {
            return Err(format!(
                "not a regular file of uid {me} writable by it alone (uid {}, mode {:o})",
                meta.uid(),
                meta.permissions().mode() & 0o7777
            ));
        }
        let bytes = std::fs::read(&path).map_err(|e| e.to_string())?;
        decode(&bytes, cfg.events.endpoint.as_deref().unwrap_or_default())
    };
    let got = read();
    let _ = std::fs::remove_file(&path);
    match got {
        Ok(c) => Some(c),
        Err(why) => {
            tracing::warn!(path = %path.display(), reason = %why, "ignoring the KV event continuation: starting a new stream");
            None
        }
    }
}

/// The blocks a stopped predecessor announced, adopted or moved (see the module docs).
pub fn adopt(engine: &kvnode_engine::Engine, c: Continuation) {
    let dram: Vec<_> = c.dram.into_iter().map(|(k, m)| (k, Arc::new(m))).collect();
    engine.adopt_after_restart(c.nvme, dram);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_continuation_reads_back_and_anything_else_is_refused() {
        let h = HandedOver {
            seq: 77,
            nvme: Vec::new(),
            dram: Vec::new(),
            retired: kvnode_engine::residency::Retired::default(),
        };
        let b = encode("ipc:///run/ev", &h);
        let c = decode(&b, "ipc:///run/ev").expect("reads back");
        assert_eq!((c.seq, c.nvme.len(), c.dram.len()), (77, 0, 0));
        assert!(
            decode(&b, "ipc:///run/other")
                .unwrap_err()
                .contains("other")
        );
        for cut in 0..b.len() {
            assert!(decode(&b[..cut], "ipc:///run/ev").is_err(), "cut at {cut}");
        }
        let mut more = b.clone();
        more.push(0);
        assert!(decode(&more, "ipc:///run/ev").is_err());
        let lying = String::from_utf8_lossy(&b).replace("nvme 8", "nvme 99999999999");
        assert!(decode(lying.as_bytes(), "ipc:///run/ev").is_err());
        // Arbitrary and mutated bytes: an error, never a panic.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut m = b.clone();
            let at = (x as usize) % m.len();
            m[at] = (x >> 32) as u8;
            m.truncate(m.len() - (round % 3));
            let _ = decode(&m, "ipc:///run/ev");
            let junk: Vec<u8> = (0..(x % 64)).map(|i| (x >> (i % 56)) as u8).collect();
            let _ = decode(&junk, "ipc:///run/ev");
        }
    }

    fn cfg_in(dir: &std::path::Path) -> EngineConfig {
        let mut cfg = EngineConfig::default();
        cfg.events.endpoint = Some("ipc:///run/ev".into());
        cfg.spill.dirs = vec![kvnode_engine::nvme::config::SpillDirSetting {
            path: dir.to_owned(),
            size: 1 << 30,
        }];
        cfg
    }

    #[test]
    fn a_continuation_others_may_write_is_refused_and_removed_and_a_good_one_is_used_once() {
        let dir =
            std::env::temp_dir().join(format!("kvnode-restart-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = cfg_in(&dir);
        let path = dir.join(FILE);
        let h = HandedOver {
            seq: 9,
            nvme: Vec::new(),
            dram: Vec::new(),
            retired: kvnode_engine::residency::Retired::default(),
        };
        std::fs::write(&path, encode("ipc:///run/ev", &h)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(
            load(&cfg).is_none(),
            "a file others may write is not trusted"
        );
        assert!(!path.exists(), "and it is removed");
        std::fs::write(&path, encode("ipc:///run/ev", &h)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load(&cfg).map(|c| c.seq), Some(9));
        assert!(load(&cfg).is_none(), "used once");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
