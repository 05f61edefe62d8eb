//! Engine configuration. Every field has a default; `kvnode serve` runs with none given.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::size_serde::{de_opt_size, de_size, ser_opt_size, ser_size};

use crate::nvme::config::{EventsSettings, SpillSettings};
use crate::peer::PeerConfig;
use crate::policy::PolicyKind;
use crate::tenant::TenantsConfig;

/// Smallest DRAM tier accepted.
pub const MIN_DRAM: u64 = 8 << 20;
/// Cap of the default DRAM size.
pub const DEFAULT_DRAM_CAP: u64 = 32 << 30;

/// The engine's configuration (the `[engine]`-less top level of the TOML file).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent on/off switches, each one TOML key"
)]
pub struct EngineConfig {
    /// Unix socket path. Default: `$XDG_RUNTIME_DIR/kvnode/kvnode.sock`, else
    /// `/run/kvnode/kvnode.sock`.
    pub socket: PathBuf,
    /// DRAM tier size. Default: a quarter of available memory, at most 32 GiB, at least 8 MiB.
    #[serde(serialize_with = "ser_size", deserialize_with = "de_size")]
    pub dram: u64,
    /// Slab size: unit of memory moved between slot classes, and the largest slot.
    /// Default: dram / 16 rounded down to 2 MiB, between 2 MiB and 64 MiB.
    #[serde(serialize_with = "ser_opt_size", deserialize_with = "de_opt_size")]
    pub slab_size: Option<u64>,
    /// Eviction policy: `lru`, `s3fifo` or `chain` (made for prefix-chained KV blocks: a
    /// request's pages evicted from the tail, reuse remembered across evictions; higher hit
    /// rates than LRU on the Mooncake traces when DRAM is short, docs/eviction.md).
    /// Default: `lru`.
    pub eviction: PolicyKind,
    /// Lock the arena in memory (mlock) in the background. Default: true. When
    /// RLIMIT_MEMLOCK is too low the daemon says so once and runs unpinned.
    pub pin: bool,
    /// Fault the arena in ahead of use, in the background. Default: true.
    pub populate: bool,
    /// Back the arena with hugetlbfs pages (`MFD_HUGETLB`, 2 MiB); needs pages reserved in
    /// `/proc/sys/vm/nr_hugepages`. Default: false (transparent huge pages are advised).
    pub hugetlb: bool,
    /// Seconds to let in-flight requests finish after SIGTERM/SIGINT. Default: 5.
    pub drain_timeout_s: f64,
    /// Socket file permissions. Default: 0o660 (owner and group may connect).
    pub socket_mode: u32,
    /// Serve although the socket's directory is writable by group or others (flag
    /// `--allow-shared-socket-dir`). Default: false, and such a directory is refused at
    /// start-up: another user could replace the socket or bind its takeover socket first.
    pub allow_shared_socket_dir: bool,
    /// Takeover socket (flag `--takeover-socket`): where a successor (`serve --takeover`)
    /// asks this daemon for its DRAM tier. Its directory must be the daemon's alone (owned by
    /// its uid, writable by nobody else; created 0700 when missing) and must not be the
    /// client socket's directory, which engines see. Default: `<socket dir>-admin/<socket
    /// name>.takeover`, e.g. `/run/kvnode-admin/kvnode.sock.takeover`.
    pub takeover_socket: Option<PathBuf>,
    /// Client uids allowed to connect, checked with `SO_PEERCRED` at accept (with
    /// `allow_gids`: a client matching either list is allowed). Default: empty, and with both
    /// lists empty the socket's file mode alone decides who may connect.
    pub allow_uids: Vec<u32>,
    /// Client gids (the peer's effective gid) allowed to connect; see `allow_uids`.
    pub allow_gids: Vec<u32>,
    /// Tenant map, quotas (`[tenants]`, docs/operations.md). Default: one tenant.
    pub tenants: TenantsConfig,
    /// A connection that has not completed its `Hello` within this many seconds is closed.
    /// Default: 10.
    pub hello_timeout_s: f64,
    /// Connections one uid may have open that have not sent their `Hello` yet; more are
    /// refused at accept. Default: 256.
    pub max_pre_hello_per_uid: u32,
    /// The payload of one `Put` must arrive within this many seconds plus one second per
    /// 64 MiB (time the daemon itself waits for DRAM room does not count); else the
    /// connection is closed and its reservations freed (`kvnode_put_payload_timeouts_total`).
    /// Default: 10.
    pub put_payload_timeout_s: f64,
    /// NVMe spill tier (`[spill]`); off by default.
    pub spill: SpillSettings,
    /// KV events (`[events]`); off by default.
    pub events: EventsSettings,
    /// A lease held longer than this is reported once (log, `kvnode_leases_overdue`, the
    /// `lease_overdue` probe). Default: 60.
    pub lease_age_limit_s: f64,
    /// A client op in flight longer than this (or arena pinning without progress for this
    /// long) is reported once as a stall. Default: 10.
    pub op_deadline_s: f64,
    /// Serve Prometheus text at `http://HOST:PORT/metrics`. Default: off.
    pub metrics: Option<String>,
    /// Serve the router entry at `http://HOST:PORT/v1/act` (docs/router-entry.md); needs a
    /// cluster key and events. Default: off.
    pub router_listen: Option<String>,
    /// Peer pulls (`[peer]` table). Default: disabled.
    pub peer: PeerConfig,
    /// How client regions whose memfd cannot be sealed (SGLang's) are copied. Default:
    /// `guarded`. Sealable memfds are sealed and copied through the mapping either way.
    pub region_copy: RegionCopy,
    /// Fetch plans (`[plans]` table; docs/fetch-plans.md).
    pub plans: PlansConfig,
}

/// How fetch plans probe paths that have no recent measurement (config `[plans]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlansConfig {
    /// Most bytes a plan takes from a path never measured (its probe). Default 4MiB.
    #[serde(serialize_with = "ser_size", deserialize_with = "de_size")]
    pub probe_bytes: u64,
    /// Most predicted milliseconds a probe of a measured but stale path may cost. Default 20.
    pub probe_ms: f64,
    /// A path's figure older than this is probed again, so one that recovered is seen.
    /// Default 30 s.
    pub reprobe_s: f64,
    /// A fetch is planned only where it beats recomputing with its predicted time raised
    /// by this fraction. Default 0.1.
    pub margin: f64,
}

impl Default for PlansConfig {
    fn default() -> Self {
        Self {
            probe_bytes: 4 << 20,
            probe_ms: 20.0,
            reprobe_s: 30.0,
            margin: 0.1,
        }
    }
}

impl PlansConfig {
    fn validate(&self) -> Result<(), String> {
        if !(4096..=(1 << 30)).contains(&self.probe_bytes) {
            return Err("plans.probe_bytes must be between 4KiB and 1GiB".into());
        }
        if !(0.0..=10_000.0).contains(&self.probe_ms) {
            return Err("plans.probe_ms must be between 0 and 10000".into());
        }
        if !(0.1..=86_400.0).contains(&self.reprobe_s) {
            return Err("plans.reprobe_s must be between 0.1 and 86400".into());
        }
        if !(0.0..=10.0).contains(&self.margin) {
            return Err("plans.margin must be between 0 and 10".into());
        }
        Ok(())
    }
}

/// How the daemon copies an unsealable client region (config `region_copy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegionCopy {
    /// memcpy through a shared mapping, guarded against the client shrinking the file
    /// (SIGBUS handler, kvnode-shmguard). Default.
    #[default]
    Guarded,
    /// pread/pwrite on the descriptor (no mapping, no signal handler; slower).
    Pread,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            socket: default_socket(),
            dram: default_dram(),
            slab_size: None,
            eviction: PolicyKind::Lru,
            pin: true,
            populate: true,
            hugetlb: false,
            drain_timeout_s: 5.0,
            socket_mode: 0o660,
            allow_shared_socket_dir: false,
            takeover_socket: None,
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
            tenants: TenantsConfig::default(),
            hello_timeout_s: 10.0,
            max_pre_hello_per_uid: 256,
            put_payload_timeout_s: 10.0,
            spill: SpillSettings::default(),
            events: EventsSettings::default(),
            lease_age_limit_s: 60.0,
            op_deadline_s: 10.0,
            metrics: None,
            router_listen: None,
            peer: PeerConfig::default(),
            region_copy: RegionCopy::Guarded,
            plans: PlansConfig::default(),
        }
    }
}

impl EngineConfig {
    /// The slab size in force.
    pub fn slab_bytes(&self) -> u64 {
        self.slab_size.unwrap_or_else(|| {
            let two = 2u64 << 20;
            ((self.dram / 16) / two * two).clamp(two, 64 << 20)
        })
    }

    /// Checks values that cannot work.
    pub fn validate(&self) -> Result<(), String> {
        self.plans.validate()?;
        if self.dram < MIN_DRAM {
            return Err(format!("dram = {} is below the minimum of 8MiB", self.dram));
        }
        let slab = self.slab_bytes();
        if !slab.is_multiple_of(4096) || slab == 0 {
            return Err(format!(
                "slab_size = {slab} must be a positive multiple of 4KiB"
            ));
        }
        if slab > self.dram {
            return Err(format!(
                "slab_size = {slab} is larger than dram = {}",
                self.dram
            ));
        }
        if !(0.01..=3600.0).contains(&self.hello_timeout_s) {
            return Err("hello_timeout_s must be between 0.01 and 3600".into());
        }
        if !(0.01..=3600.0).contains(&self.put_payload_timeout_s) {
            return Err("put_payload_timeout_s must be between 0.01 and 3600".into());
        }
        if self.max_pre_hello_per_uid == 0 {
            return Err("max_pre_hello_per_uid must be at least 1".into());
        }
        if !(0.0..=3600.0).contains(&self.drain_timeout_s) {
            return Err("drain_timeout_s must be between 0 and 3600".into());
        }
        if !(0.001..=86400.0).contains(&self.lease_age_limit_s)
            || !(0.001..=86400.0).contains(&self.op_deadline_s)
        {
            return Err(
                "lease_age_limit_s and op_deadline_s must be between 0.001 and 86400".into(),
            );
        }
        self.tenants.validate().map_err(|e| e.to_string())?;
        self.spill.validate()?;
        self.events.validate()?;
        self.peer.validate().map_err(|e| e.to_string())?;
        self.takeover_path()?;
        self.check_keyless_peer_listener()?;
        self.check_router_entry()
    }

    /// The router entry authenticates routers with the cluster key and names blocks by the
    /// hashes the events announce: without either it could only refuse everything.
    fn check_router_entry(&self) -> Result<(), String> {
        if self.router_listen.is_none() {
            return Ok(());
        }
        if self.peer.cluster_key.is_none() {
            return Err(
                "the router entry (--router-listen) authenticates routers with the cluster key: give the daemon a --cluster-key"
                    .into(),
            );
        }
        if self.events.endpoint.is_none() {
            return Err(
                "the router entry (--router-listen) names blocks by the hashes of the KV events: give the daemon --events"
                    .into(),
            );
        }
        Ok(())
    }

    /// The takeover socket in force: `takeover_socket`, else `<socket dir>-admin/<socket
    /// name>.takeover`. An error when it would sit in the client socket's directory (every
    /// engine that reaches the client socket would see it) or cannot be derived.
    pub fn takeover_path(&self) -> Result<PathBuf, String> {
        let parent = self
            .socket
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let client_dir = std::path::absolute(parent)
            .map_err(|e| format!("socket {}: {e}", self.socket.display()))?;
        let path = if let Some(p) = &self.takeover_socket {
            std::path::absolute(p).map_err(|e| format!("takeover_socket {}: {e}", p.display()))?
        } else {
            default_takeover_path(&client_dir, &self.socket)?
        };
        if path.parent() == Some(client_dir.as_path()) {
            return Err(format!(
                "takeover_socket {} is in the client socket's directory {}: every engine that reaches the client socket would see it. Put it in a directory only the daemon's uid may enter (default: {}-admin)",
                path.display(),
                client_dir.display(),
                client_dir.display()
            ));
        }
        Ok(path)
    }

    /// A keyless peer listener authenticates nobody: any local user completes its handshake
    /// and pulls every block it can name, past the socket's mode, the allowlist and the tenant
    /// map (issue 25, item 3; issue 38, item 5). It needs the explicit switch that says so,
    /// and a daemon that restricts its clients must require the key whatever the switch.
    fn check_keyless_peer_listener(&self) -> Result<(), String> {
        if self.peer.listen.is_none() || self.peer.cluster_key.is_some() {
            return Ok(());
        }
        let restricted =
            self.tenants.enabled() || !self.allow_uids.is_empty() || !self.allow_gids.is_empty();
        if restricted {
            return Err(
                "a keyless peer listener (--peer-listen without --cluster-key) serves every block to every local user, \
                 so it cannot be combined with a tenant map or allow_uids/allow_gids: give the daemon a --cluster-key \
                 (or drop --peer-listen)"
                    .into(),
            );
        }
        if !self.peer.keyless_serves_every_local_user {
            return Err(
                "a peer listener without --cluster-key authenticates nobody: every local user could pull every block, \
                 whatever the client socket's mode. Give the daemon a --cluster-key, or say that this is intended with \
                 --peer-keyless-serves-every-local-user ([peer] keyless_serves_every_local_user = true)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// `<client_dir>-admin/<socket name>.takeover` (`client_dir` absolute).
fn default_takeover_path(client_dir: &Path, socket: &Path) -> Result<PathBuf, String> {
    let (Some(parent), Some(dir), Some(name)) = (
        client_dir.parent(),
        client_dir.file_name(),
        socket.file_name(),
    ) else {
        return Err(format!(
            "socket {}: cannot derive the takeover socket (<socket dir>-admin/<name>.takeover) from it; set takeover_socket",
            socket.display()
        ));
    };
    let mut admin = dir.to_owned();
    admin.push("-admin");
    let mut file = name.to_owned();
    file.push(".takeover");
    Ok(parent.join(admin).join(file))
}

/// `$XDG_RUNTIME_DIR/kvnode/kvnode.sock`, else `/run/kvnode/kvnode.sock`.
pub fn default_socket() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/run"), PathBuf::from)
        .join("kvnode/kvnode.sock")
}

/// A quarter of `MemAvailable`, capped at 32 GiB, at least 8 MiB, in 2 MiB units.
pub fn default_dram() -> u64 {
    let avail = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(1 << 30, |kib| kib * 1024);
    let two = 2u64 << 20;
    ((avail / 4).min(DEFAULT_DRAM_CAP) / two * two).max(MIN_DRAM)
}
