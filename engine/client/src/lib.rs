//! kvnode-client: a blocking Rust client for the kvnode daemon.
//!
//! ```text
//!  Client ──Unix socket frames──> daemon
//!    └── maps the daemon's arena memfd (received at Hello) for zero-copy get/alloc
//! ```
//!
//! One `Client` per thread: it is `Send`, not `Sync`. See docs/client-protocol.md.

mod arena;
mod conn;
mod gpu;
pub mod report;
mod retry;
pub mod router;
pub mod seeded;

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};

use kvnode_proto::client::{
    AllocSlot, BlockMeta, CommitStatus, ErrorCode, Extent, GetMode, Op, PutStatus, Reply,
    SegmentClass,
};
use kvnode_proto::obs::LatencyReport;
use kvnode_proto::pull::{OpReport, TimeoutReport};
use kvnode_proto::stats::StatsReport;
use kvnode_proto::{Key, NamespaceSpec};

pub use arena::ArenaMap;
pub use gpu::GpuBuffer;
pub use kvnode_proto;

/// Client failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// A local CUDA call failed (registering the arena mapping).
    #[error("{0}")]
    Gpu(#[from] kvnode_gpu::GpuError),
    /// Socket I/O.
    #[error("kvnode socket I/O failed: {0} (is the daemon running? `kvnode serve`)")]
    Io(#[from] std::io::Error),
    /// The daemon answered with an error.
    #[error("kvnode refused the request ({code:?}): {message}")]
    Server {
        /// Category.
        code: ErrorCode,
        /// Daemon's explanation.
        message: String,
    },
    /// A holding get (lease mode, GPU onload) cannot have all its pages leased now; only
    /// the leading `leasable` can. [`Client::get_lease_each`] splits the request on it.
    #[error("kvnode: only the leading {leasable} keys can be leased now: {message}")]
    TooLarge {
        /// Leading keys one request can lease now.
        leasable: u32,
        /// Daemon's explanation.
        message: String,
    },
    /// The daemon sent something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, ClientError>;

/// A lookup's answer with its fetch plan ([`Client::exists_plan`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// Leading keys held on the node now.
    pub count: u32,
    /// The daemon's plan: fetch `plan.keys` leading keys, recompute the rest.
    pub plan: kvnode_proto::plan::FetchPlan,
    /// The pull a hint started (only when the plan takes the peer).
    pub pull: Option<OpReport>,
}

/// Inline get results: bytes per key, `None` for misses.
pub type Pages = Vec<Option<Vec<u8>>>;

/// A registered namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// Handle for requests.
    pub ns: u32,
    /// 128-bit id, hex.
    pub id: String,
    /// Slot class per segment.
    pub segments: Vec<SegmentClass>,
}

/// A `GetToRegion`'s answer: bytes written per key (`None`: not written) and, with a hint,
/// the pull's report.
pub type RegionGot = (Vec<Option<u64>>, Option<Box<OpReport>>);

/// A lease on arena extents (read them with [`Client::arena`]); release it when done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Lease id (0 when nothing was found).
    pub id: u64,
    /// Extent per key, `None` for misses.
    pub extents: Vec<Option<Extent>>,
}

impl Lease {
    /// Number of leading keys found.
    pub fn leading_hits(&self) -> usize {
        self.extents.iter().take_while(|e| e.is_some()).count()
    }
}

/// A connection to the daemon.
#[derive(Debug)]
pub struct Client {
    conn: conn::Conn,
    arena: ArenaMap,
    pid: u32,
    /// The socket, to reconnect after a takeover (retry.rs).
    path: PathBuf,
    /// (device, inode) of the arena memfd, if one was passed.
    arena_id: Option<(u64, u64)>,
    /// Namespaces registered on this connection, with their handles (retry.rs).
    namespaces: Vec<(NamespaceSpec, u32)>,
}

pub(crate) fn unexpected(r: &Reply) -> ClientError {
    match r {
        Reply::Error { code, message } => ClientError::Server {
            code: *code,
            message: message.clone(),
        },
        Reply::TooLarge { leasable, message } => ClientError::TooLarge {
            leasable: *leasable,
            message: message.clone(),
        },
        other => ClientError::Protocol(format!("unexpected reply {other:?}")),
    }
}

/// Where a `GetToRegion` writes: the region and each key's offset and room in it.
#[derive(Clone, Copy)]
struct RegionDest<'a> {
    region: u32,
    offsets: &'a [u64],
    lens: &'a [u64],
}

impl Client {
    /// Connects, performs the handshake and maps the daemon's arena.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self> {
        let (conn, hello, fd) = conn::Conn::connect(path.as_ref(), "kvnode-client")?;
        let Reply::HelloOk {
            arena_bytes, pid, ..
        } = hello
        else {
            return Err(unexpected(&hello));
        };
        let arena_id = fd.as_ref().and_then(retry::file_id);
        let arena = match fd {
            Some(fd) => ArenaMap::map(&fd, arena_bytes)?,
            // The daemon withholds the arena from this client's tenant (share_arena = false).
            None if arena_bytes == 0 => ArenaMap::none(),
            None => {
                return Err(ClientError::Protocol(
                    "daemon sent no arena descriptor".into(),
                ));
            }
        };
        Ok(Self {
            conn,
            arena,
            pid,
            path: path.as_ref().to_owned(),
            arena_id,
            namespaces: Vec::new(),
        })
    }

    /// The daemon's pid.
    pub fn daemon_pid(&self) -> u32 {
        self.pid
    }

    /// The mapped arena.
    pub fn arena(&self) -> &ArenaMap {
        &self.arena
    }

    /// Sends `op`; one the daemon's takeover cut is sent again on a new connection
    /// (retry.rs).
    pub(crate) fn call(&mut self, op: Op) -> Result<Reply> {
        let o = op.clone();
        let mut first = Some(op);
        self.retrying(&o, |c| {
            let op = first.take().unwrap_or_else(|| o.clone());
            c.call(op, &[]).and_then(retry::refused)
        })
    }

    /// Registers a namespace (idempotent).
    pub fn register(&mut self, spec: &NamespaceSpec) -> Result<Namespace> {
        match self.call(Op::Register { spec: spec.clone() })? {
            Reply::Registered { ns, id, segments } => {
                self.registered(spec, ns);
                Ok(Namespace { ns, id, segments })
            }
            r => Err(unexpected(&r)),
        }
    }

    /// Stores blocks inline.
    pub fn put(&mut self, ns: u32, keys: &[Key], blocks: &[&[u8]]) -> Result<Vec<PutStatus>> {
        self.put_with_meta(ns, keys, blocks, Vec::new())
    }

    /// Stores blocks inline with router metadata (tokens, parent) per key; `meta` is empty
    /// or has one entry per key. Blocks with tokens are announced as KV events.
    pub fn put_with_meta(
        &mut self,
        ns: u32,
        keys: &[Key],
        blocks: &[&[u8]],
        meta: Vec<Option<BlockMeta>>,
    ) -> Result<Vec<PutStatus>> {
        let lens = blocks.iter().map(|b| b.len() as u64).collect();
        let op = Op::Put {
            ns,
            keys: keys.to_vec(),
            lens,
            meta,
        };
        match self.retrying(&op, |c| c.call(op.clone(), blocks).and_then(retry::refused))? {
            Reply::Put { results } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Reserves arena slots to fill in place.
    pub fn alloc(&mut self, ns: u32, keys: &[Key], lens: &[u64]) -> Result<Vec<AllocSlot>> {
        match self.call(Op::Alloc {
            ns,
            keys: keys.to_vec(),
            lens: lens.to_vec(),
            meta: Vec::new(),
        })? {
            Reply::Alloc { slots } => Ok(slots),
            r => Err(unexpected(&r)),
        }
    }

    /// Publishes filled slots.
    pub fn commit(&mut self, handles: &[u64]) -> Result<Vec<CommitStatus>> {
        match self.call(Op::Commit {
            handles: handles.to_vec(),
        })? {
            Reply::Commit { results } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Gives back reserved slots.
    pub fn abort(&mut self, handles: &[u64]) -> Result<u32> {
        match self.call(Op::Abort {
            handles: handles.to_vec(),
        })? {
            Reply::Aborted { count } => Ok(count),
            r => Err(unexpected(&r)),
        }
    }

    /// Gets blocks inline as owned vectors.
    pub fn get(&mut self, ns: u32, keys: &[Key]) -> Result<Vec<Option<Vec<u8>>>> {
        self.get_hinted(ns, keys, None, None).map(|(v, _)| v)
    }

    /// Gets blocks inline; with a router hint the daemon first pulls the covered missing
    /// prefix from the hinted peer (waiting up to `deadline_ms`) and reports the operation.
    pub fn get_hinted(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
        deadline_ms: Option<u64>,
    ) -> Result<(Pages, Option<OpReport>)> {
        let op = Op::Get {
            ns,
            keys: keys.to_vec(),
            mode: GetMode::Inline,
            hint: hint.map(str::to_owned),
            deadline_ms,
        };
        let (reply, mut payload) = self.retrying(&op, |c| {
            let (r, p) = c.call_with_payload(op.clone())?;
            Ok((retry::refused(r)?, p))
        })?;
        let Reply::GetInline { lens, pull } = reply else {
            return Err(unexpected(&reply));
        };
        let mut out = Vec::with_capacity(lens.len());
        let mut off = 0usize;
        for l in lens {
            out.push(l.map(|l| {
                let v = payload[off..off + l as usize].to_vec();
                off += l as usize;
                v
            }));
        }
        payload.clear();
        Ok((out, pull.map(|p| *p)))
    }

    /// Gets blocks inline straight into caller buffers (one per key, each large enough);
    /// returns the length written per key (`None` = miss).
    pub fn get_into(
        &mut self,
        ns: u32,
        keys: &[Key],
        dst: &mut [&mut [u8]],
    ) -> Result<Vec<Option<u64>>> {
        self.conn.get_into(ns, keys, dst)
    }

    /// Gets blocks as a lease on arena extents.
    pub fn get_lease(&mut self, ns: u32, keys: &[Key]) -> Result<Lease> {
        self.get_lease_hinted(ns, keys, None, None).map(|(l, _)| l)
    }

    /// Lease get with an optional router hint (see [`Client::get_hinted`]).
    pub fn get_lease_hinted(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
        deadline_ms: Option<u64>,
    ) -> Result<(Lease, Option<OpReport>)> {
        match self.call(Op::Get {
            ns,
            keys: keys.to_vec(),
            mode: GetMode::Lease,
            hint: hint.map(str::to_owned),
            deadline_ms,
        })? {
            Reply::GetLease {
                lease,
                extents,
                pull,
            } => Ok((Lease { id: lease, extents }, pull.map(|p| *p))),
            r => Err(unexpected(&r)),
        }
    }

    /// Lease get of any length: asks for the keys from the first not yet handed over; when
    /// the daemon answers `TooLarge`, asks again for the leading part it can lease. Each
    /// part's lease is given to `f` with the index of its first key, then released, before
    /// the next is asked for. Fails with `TooLarge { leasable: 0 }` when not even one key
    /// can be leased now.
    pub fn get_lease_each(
        &mut self,
        ns: u32,
        keys: &[Key],
        mut f: impl FnMut(usize, &Lease, &ArenaMap),
    ) -> Result<()> {
        let mut at = 0;
        while at < keys.len() {
            let mut want = keys.len() - at;
            let lease = loop {
                match self.get_lease(ns, &keys[at..at + want]) {
                    Ok(l) => break l,
                    Err(ClientError::TooLarge { leasable, .. })
                        if leasable > 0 && (leasable as usize) < want =>
                    {
                        want = leasable as usize;
                    }
                    Err(e) => return Err(e),
                }
            };
            f(at, &lease, &self.arena);
            if lease.id != 0 {
                self.release(lease.id)?;
            }
            at += want;
        }
        Ok(())
    }

    /// Ends a lease.
    pub fn release(&mut self, lease: u64) -> Result<()> {
        match self.call(Op::Release { lease })? {
            Reply::Released => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Number of leading keys present.
    pub fn exists(&mut self, ns: u32, keys: &[Key]) -> Result<u32> {
        self.exists_hinted(ns, keys, None).map(|(n, _)| n)
    }

    /// Number of leading keys present; with a hint, also starts pulling the covered missing
    /// prefix in the background and reports that operation.
    pub fn exists_hinted(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
    ) -> Result<(u32, Option<OpReport>)> {
        match self.call(Op::Exists {
            ns,
            keys: keys.to_vec(),
            hint: hint.map(str::to_owned),
            recompute: None,
        })? {
            Reply::Exists { count, pull, .. } => Ok((count, pull.map(|p| *p))),
            r => Err(unexpected(&r)),
        }
    }

    /// A lookup with the engine's recompute cost: the leading keys held now, the daemon's
    /// fetch plan (fetch `plan.keys`, recompute the rest; docs/fetch-plans.md) and, with a
    /// hint, the pull it started (only when the plan takes the peer).
    pub fn exists_plan(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: Option<&str>,
        cost: &kvnode_proto::plan::RecomputeCost,
    ) -> Result<Planned> {
        match self.call(Op::Exists {
            ns,
            keys: keys.to_vec(),
            hint: hint.map(str::to_owned),
            recompute: Some(cost.clone()),
        })? {
            Reply::Exists {
                count,
                pull,
                plan: Some(plan),
            } => Ok(Planned {
                count,
                plan: *plan,
                pull: pull.map(|p| *p),
            }),
            r => Err(unexpected(&r)),
        }
    }

    /// Executes every action of a router's hints envelope (`kv.prefetch`, `kv.retain`,
    /// `kv.release`, `kv.demote`, `kv.evict`, `kv.fetch`) for the request's `keys`: one
    /// result per action, in order, with the envelope's `message_id`. An action the daemon
    /// does not execute comes back `Refused` by name; the others still run.
    pub fn act(
        &mut self,
        ns: u32,
        keys: &[Key],
        hints: &str,
    ) -> Result<(String, Vec<kvnode_proto::actions::ActionResult>)> {
        match self.call(Op::Act {
            ns,
            keys: keys.to_vec(),
            hints: hints.to_owned(),
        })? {
            Reply::Acted {
                message_id,
                results,
            } => Ok((message_id, results)),
            r => Err(unexpected(&r)),
        }
    }

    /// Starts a pull operation; with `into` (Alloc handles, one per key) pulled bytes are
    /// copied into those slots, which come back when the op ends.
    pub fn pull(
        &mut self,
        ns: u32,
        keys: &[Key],
        hint: &str,
        into: &[u64],
        deadline_ms: Option<u64>,
    ) -> Result<OpReport> {
        self.op_reply(Op::Pull {
            ns,
            keys: keys.to_vec(),
            hint: hint.to_owned(),
            into: into.to_vec(),
            deadline_ms,
        })
    }

    /// Waits up to `timeout_ms` for an operation to end.
    pub fn wait(&mut self, op: u64, timeout_ms: u64) -> Result<OpReport> {
        self.op_reply(Op::Wait { op, timeout_ms })
    }

    /// Cancels an operation; returns once nothing will write into its buffers again.
    pub fn cancel(&mut self, op: u64) -> Result<OpReport> {
        self.op_reply(Op::Cancel { op })
    }

    fn op_reply(&mut self, op: Op) -> Result<OpReport> {
        match self.call(op)? {
            Reply::Op(r) => Ok(*r),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's declared prefetch timeout model.
    pub fn timeouts(&mut self) -> Result<TimeoutReport> {
        match self.call(Op::Timeouts)? {
            Reply::Timeouts(t) => Ok(*t),
            r => Err(unexpected(&r)),
        }
    }

    /// Removes blocks; returns how many existed.
    pub fn delete(&mut self, ns: u32, keys: &[Key]) -> Result<u32> {
        match self.call(Op::Delete {
            ns,
            keys: keys.to_vec(),
        })? {
            Reply::Deleted { count } => Ok(count),
            r => Err(unexpected(&r)),
        }
    }

    /// Refreshes the leading run of `keys` held in the daemon's DRAM in its eviction policy,
    /// as a get would, without reading them; returns the run's length. For pages an engine
    /// found in its GPU prefix cache: their hits never reach the daemon otherwise.
    pub fn touch(&mut self, ns: u32, keys: &[Key]) -> Result<u32> {
        match self.call(Op::Touch {
            ns,
            keys: keys.to_vec(),
        })? {
            Reply::Touched { count } => Ok(count),
            r => Err(unexpected(&r)),
        }
    }

    /// Removes every block of a namespace (or all); returns how many.
    pub fn clear(&mut self, ns: Option<u32>) -> Result<u64> {
        match self.call(Op::Clear { ns })? {
            Reply::Cleared { count } => Ok(count),
            r => Err(unexpected(&r)),
        }
    }

    /// Lets the daemon map `len` bytes of `fd` (a memfd opened read-write); returns the
    /// region id for [`Client::get_to_region`] and [`Client::put_from_region`].
    pub fn attach_region(&mut self, fd: BorrowedFd<'_>, len: u64) -> Result<u32> {
        match self.conn.call_with_fd(Op::AttachRegion { len }, fd)? {
            Reply::RegionAttached { region, .. } => Ok(region),
            r => Err(unexpected(&r)),
        }
    }

    /// Unmaps a region from the daemon.
    pub fn detach_region(&mut self, region: u32) -> Result<()> {
        match self.call(Op::DetachRegion { region })? {
            Reply::RegionDetached => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    /// Copies blocks into the region at `offsets` (room `lens` each); returns the bytes
    /// written per key (`None` = miss). All writes are complete when this returns.
    pub fn get_to_region(
        &mut self,
        ns: u32,
        keys: &[Key],
        region: u32,
        offsets: &[u64],
        lens: &[u64],
    ) -> Result<Vec<Option<u64>>> {
        let to = RegionDest {
            region,
            offsets,
            lens,
        };
        self.region_get(ns, keys, to, None, None)
            .map(|(lens, _)| lens)
    }

    fn region_get(
        &mut self,
        ns: u32,
        keys: &[Key],
        to: RegionDest<'_>,
        hint: Option<&str>,
        deadline_ms: Option<u64>,
    ) -> Result<RegionGot> {
        let RegionDest {
            region,
            offsets,
            lens,
        } = to;
        match self.call(Op::GetToRegion {
            ns,
            keys: keys.to_vec(),
            region,
            offsets: offsets.to_vec(),
            lens: lens.to_vec(),
            hint: hint.map(str::to_owned),
            deadline_ms,
        })? {
            Reply::GotToRegion { lens, pull } => Ok((lens, pull)),
            r => Err(unexpected(&r)),
        }
    }

    /// [`Client::get_to_region`] with a router hint: keys this node lacks are pulled from the
    /// hinted peer and each is copied into the region as soon as it has landed. Returns the
    /// per-key lengths and the pull's report.
    #[expect(clippy::too_many_arguments, reason = "the op's fields, as on the wire")]
    pub fn get_to_region_hinted(
        &mut self,
        ns: u32,
        keys: &[Key],
        region: u32,
        offsets: &[u64],
        lens: &[u64],
        hint: &str,
        deadline_ms: Option<u64>,
    ) -> Result<RegionGot> {
        let to = RegionDest {
            region,
            offsets,
            lens,
        };
        self.region_get(ns, keys, to, Some(hint), deadline_ms)
    }

    /// Stores blocks the daemon reads from the region at `offsets`, `lens` bytes each.
    pub fn put_from_region(
        &mut self,
        ns: u32,
        keys: &[Key],
        region: u32,
        offsets: &[u64],
        lens: &[u64],
    ) -> Result<Vec<PutStatus>> {
        match self.call(Op::PutFromRegion {
            ns,
            keys: keys.to_vec(),
            region,
            offsets: offsets.to_vec(),
            lens: lens.to_vec(),
        })? {
            Reply::Put { results } => Ok(results),
            r => Err(unexpected(&r)),
        }
    }

    /// Daemon statistics.
    pub fn stats(&mut self) -> Result<StatsReport> {
        match self.call(Op::Stats)? {
            Reply::Stats(s) => Ok(*s),
            r => Err(unexpected(&r)),
        }
    }

    /// Cluster membership: health and the live members (daemons started with `--cluster`;
    /// others answer with an `Unsupported` error).
    pub fn cluster(&mut self) -> Result<kvnode_proto::cluster::ClusterReport> {
        match self.call(Op::Cluster)? {
            Reply::Cluster(r) => Ok(*r),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's live latency histograms (per op and tier) and throughput over time.
    pub fn histograms(&mut self) -> Result<LatencyReport> {
        match self.call(Op::Histograms)? {
            Reply::Histograms(h) => Ok(*h),
            r => Err(unexpected(&r)),
        }
    }
}
