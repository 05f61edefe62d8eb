//! The agent: one tokio task per daemon that registers this daemon in etcd under a lease,
//! keeps the lease alive, and keeps the [`View`] current from a watch.
//!
//! ```text
//!  loop:  connect ─> grant lease (ttl) ─> put record (with lease) ─> list prefix ─> View::reload
//!           └─> watch prefix from the listing's revision + 1
//!                 every ttl/3: keep-alive; answer ─> View::confirm; no answer for 2 ticks ─> fail
//!                 watch PUT ─> View::upsert   DELETE (lease expired/revoked) ─> View::remove
//!         any failure ─> View::lost (grace starts) ─> wait (100 ms doubling to retry_max) ─> loop
//!  stop:  revoke the lease (bounded): the record disappears at once instead of after the ttl
//! ```
//!
//! Nothing outside this task ever waits on etcd: the hint path reads the view.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::{ClusterConfig, EtcdUrl};
use crate::error::ClusterError;
use crate::record::{MemberRecord, RECORD_VERSION};
use crate::view::{Change, Local, View};

/// Records per listing request (about 320 KB at ~320 bytes a record).
const LIST_PAGE: i64 = 1000;

/// The first key after every key that starts with `prefix` (its last byte + 1).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// What this daemon registers (the agent adds the instance id and the registration time).
#[derive(Clone, Debug, Default)]
pub struct Registration {
    /// Advertised peer endpoints (`tcp://host:port`).
    pub endpoints: Vec<String>,
    /// Transports served.
    pub transports: Vec<String>,
    /// Software version.
    pub version: String,
    /// Peer protocol version.
    pub peer_protocol: u32,
    /// Tier capacities.
    pub tiers: Vec<kvnode_proto::cluster::MemberTier>,
    /// Cluster key id (never the key).
    pub key_id: Option<String>,
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    /// The membership it keeps current.
    pub view: Arc<View>,
    /// The task; it ends (after revoking the lease) once `stop` turns true.
    pub task: JoinHandle<()>,
}

/// Everything a session needs, fixed at start.
struct Ctx {
    url: EtcdUrl,
    cfg: ClusterConfig,
    options: ConnectOptions,
    record: MemberRecord,
    key: String,
    prefix: String,
    view: Arc<View>,
}

/// Validates the settings, reads credential files, and spawns the agent on the current
/// tokio runtime. etcd being down is not an error: the agent keeps trying, and the view
/// says `connecting` meanwhile.
pub fn start(
    cfg: &ClusterConfig,
    reg: Registration,
    stop: watch::Receiver<bool>,
) -> Result<Agent, ClusterError> {
    let url = cfg.validate()?;
    let node_id = cfg.node_id();
    let options = crate::connect::options(cfg, &url)?;
    let view = Arc::new(View::new(Local {
        name: url.name.clone(),
        etcd: url.endpoints.clone(),
        node_id: node_id.clone(),
        peer_protocol: reg.peer_protocol,
        key_id: reg.key_id.clone(),
        ttl_s: cfg.ttl_s,
        grace: cfg.grace(),
    }));
    let record = MemberRecord {
        record: RECORD_VERSION,
        node_id: node_id.clone(),
        instance: instance_id(),
        endpoints: reg.endpoints,
        transports: reg.transports,
        version: reg.version,
        peer_protocol: reg.peer_protocol,
        tiers: reg.tiers,
        key_id: reg.key_id,
        registered_unix_ms: 0,
    };
    let prefix = url.members_prefix();
    let ctx = Ctx {
        key: format!("{prefix}{node_id}"),
        prefix,
        url,
        cfg: cfg.clone(),
        options,
        record,
        view: Arc::clone(&view),
    };
    let task = tokio::spawn(ctx.run(stop));
    Ok(Agent { view, task })
}

/// Random per start (std's hasher keys come from the OS's random source).
fn instance_id() -> String {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    format!("{h:016x}")
}

/// A uniform draw from [0, 1) (std's per-hasher random keys; no RNG crate needed).
fn jitter() -> f64 {
    use std::hash::BuildHasher;
    let h = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    (h >> 11) as f64 / (1u64 << 53) as f64
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `f` bounded by `limit`; a timeout is a [`ClusterError::Timeout`].
async fn bounded<T>(
    what: &'static str,
    limit: Duration,
    f: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| ClusterError::Timeout(what, limit))?
        .map_err(ClusterError::etcd(what))
}

/// How one session ended.
enum End {
    /// `stop` turned true (or its sender is gone).
    Stopped,
    /// etcd failed; `healthy` says whether the session got as far as a listing.
    Failed { error: ClusterError, healthy: bool },
}

impl Ctx {
    fn limit(&self) -> Duration {
        Duration::from_millis(self.cfg.connect_timeout_ms)
    }

    /// Keep-alive period: a third of the ttl, at least 500 ms.
    fn tick(&self) -> Duration {
        (self.cfg.ttl() / 3).max(Duration::from_millis(500))
    }

    async fn run(self, mut stop: watch::Receiver<bool>) {
        let retry_max = Duration::from_millis(self.cfg.retry_max_ms);
        let mut wait = Duration::from_millis(100);
        let mut attempts = 0u64;
        let mut expired_said = false;
        loop {
            if attempts > 0 {
                self.view.count_reconnect();
            }
            attempts += 1;
            let (error, healthy) = match self.session(&mut stop).await {
                End::Stopped => return,
                End::Failed { error, healthy } => (error, healthy),
            };
            if healthy {
                wait = Duration::from_millis(100);
                expired_said = false;
            }
            let n = self.view.len();
            if self.view.lost(error.to_string()) {
                tracing::warn!(
                    error = %error,
                    members = n,
                    grace_s = self.cfg.grace_s,
                    "cluster: etcd unreachable; the last known membership stays in force for the grace, then hints to cluster members are refused"
                );
            } else if attempts == 1 {
                tracing::warn!(
                    error = %error,
                    etcd = ?self.url.endpoints,
                    "cluster: cannot reach etcd; the daemon runs on, and hints to cluster members are refused until etcd answers"
                );
            } else {
                tracing::debug!(error = %error, "cluster: etcd still unreachable");
            }
            self.say_expired(&mut expired_said);
            // Wake at the end of the grace too, so the log says when hints start being refused.
            // Jittered (0.5x..1.5x) so that a fleet does not come back to etcd in one burst.
            let jittered = wait.mul_f64(0.5 + jitter());
            let nap = self
                .view
                .grace_left()
                .filter(|g| !g.is_zero())
                .map_or(jittered, |g| jittered.min(g + Duration::from_millis(10)));
            tokio::select! {
                () = tokio::time::sleep(nap) => {}
                _ = stop.changed() => return,
            }
            self.say_expired(&mut expired_said);
            wait = (wait * 2).min(retry_max);
        }
    }

    /// Logs, once per outage, that the grace is over.
    fn say_expired(&self, said: &mut bool) {
        if !*said && self.view.state() == kvnode_proto::cluster::ClusterState::Expired {
            *said = true;
            tracing::warn!(
                grace_s = self.cfg.grace_s,
                "cluster: etcd unreachable past the grace: hints to cluster members are refused until etcd answers"
            );
        }
    }

    /// One session: register, list, watch, keep alive until something fails or `stop`.
    async fn session(&self, stop: &mut watch::Receiver<bool>) -> End {
        let mut lease = None;
        let mut healthy = false;
        let r = tokio::select! {
            r = self.serve(&mut lease, &mut healthy) => r,
            _ = stop.changed() => Ok(()),
        };
        match r {
            Ok(()) => {
                self.revoke(lease).await;
                End::Stopped
            }
            Err(error) => End::Failed { error, healthy },
        }
    }

    /// Best effort, bounded: take this daemon out of the membership now.
    async fn revoke(&self, lease: Option<i64>) {
        let Some(id) = lease else { return };
        let limit = self.limit().min(Duration::from_secs(1));
        let done = async {
            let mut c = Client::connect(self.url.client_endpoints(), Some(self.options.clone()))
                .await
                .ok()?;
            c.lease_revoke(id).await.ok()
        };
        if let Ok(Some(_)) = tokio::time::timeout(limit, done).await {
            tracing::info!(
                lease = format!("{id:x}"),
                "cluster: lease revoked, left the membership"
            );
        } else {
            tracing::info!("cluster: could not revoke the lease; the record expires with its ttl");
        }
    }

    async fn serve(&self, lease: &mut Option<i64>, healthy: &mut bool) -> Result<(), ClusterError> {
        let limit = self.limit();
        let mut client = bounded(
            "connect",
            limit,
            Client::connect(self.url.client_endpoints(), Some(self.options.clone())),
        )
        .await?;
        // validate() bounds ttl_s to 2..=3600.
        let ttl = i64::try_from(self.cfg.ttl_s).unwrap_or(i64::MAX);
        let id = bounded("lease grant", limit, client.lease_grant(ttl, None))
            .await?
            .id();
        *lease = Some(id);
        let mut record = self.record.clone();
        record.registered_unix_ms = unix_ms();
        let put = PutOptions::new().with_lease(id);
        bounded(
            "register",
            limit,
            client.put(self.key.clone(), record.to_json(), Some(put)),
        )
        .await?;
        let (mut keeper, mut alive) =
            bounded("keep-alive", limit, client.lease_keep_alive(id)).await?;
        let (revision, records) = self.list(&mut client).await?;
        let n = records.len();
        self.view.reload(records);
        self.view.set_registered(true);
        *healthy = true;
        tracing::info!(
            node = %self.record.node_id,
            lease = format!("{id:x}"),
            ttl_s = ttl,
            members = n,
            "cluster: registered; membership loaded"
        );
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1)
            .with_progress_notify();
        let mut events = bounded(
            "watch",
            limit,
            client.watch(self.prefix.clone(), Some(opts)),
        )
        .await?;
        let tick = self.tick();
        let dead_after = tick * 2;
        let mut ticks = tokio::time::interval(tick);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_answer = Instant::now();
        loop {
            tokio::select! {
                _ = ticks.tick() => {
                    if last_answer.elapsed() > dead_after {
                        return Err(ClusterError::Timeout("keep-alive", dead_after));
                    }
                    bounded("keep-alive", tick, keeper.keep_alive()).await?;
                }
                m = alive.message() => {
                    let m = m.map_err(ClusterError::etcd("keep-alive"))?
                        .ok_or(ClusterError::StreamEnded("keep-alive"))?;
                    if m.ttl() <= 0 {
                        return Err(ClusterError::LeaseLost(id));
                    }
                    last_answer = Instant::now();
                    self.view.confirm();
                }
                w = events.message() => {
                    let w = w.map_err(ClusterError::etcd("watch"))?
                        .ok_or(ClusterError::StreamEnded("watch"))?;
                    if w.canceled() {
                        return Err(ClusterError::WatchCancelled(w.cancel_reason().to_owned()));
                    }
                    for ev in w.events() {
                        self.apply(ev)?;
                    }
                    self.view.confirm();
                }
            }
        }
    }

    /// The whole membership at one revision, in pages of [`LIST_PAGE`] records: one response
    /// would pass gRPC's 4 MiB message limit beyond about 12 000 members.
    async fn list(&self, client: &mut Client) -> Result<(i64, Vec<MemberRecord>), ClusterError> {
        let end = prefix_end(&self.prefix);
        let mut from = self.prefix.clone().into_bytes();
        let mut revision = 0;
        let mut out = Vec::new();
        loop {
            let mut o = GetOptions::new()
                .with_range(end.clone())
                .with_limit(LIST_PAGE);
            if revision > 0 {
                o = o.with_revision(revision);
            }
            let r = bounded(
                "list members",
                self.limit(),
                client.get(from.clone(), Some(o)),
            )
            .await?;
            if revision == 0 {
                revision = r.header().map_or(0, etcd_client::ResponseHeader::revision);
            }
            out.extend(
                r.kvs()
                    .iter()
                    .filter_map(|kv| self.parse(kv.key(), kv.value())),
            );
            match (r.more(), r.kvs().last()) {
                (true, Some(last)) => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok((revision, out)),
            }
        }
    }

    /// One watch event into the view (and the log).
    fn apply(&self, ev: &etcd_client::Event) -> Result<(), ClusterError> {
        let Some(kv) = ev.kv() else { return Ok(()) };
        match ev.event_type() {
            EventType::Put if self.node_of(kv.key()).as_deref() == Some(&self.record.node_id) => {
                // Our own key, written by someone else (our own put precedes the watch):
                // register again at once, so peers never follow another's endpoints for us.
                let ours = MemberRecord::parse(kv.value()).is_some_and(|r| {
                    r.instance == self.record.instance && r.endpoints == self.record.endpoints
                });
                if !ours {
                    let other = MemberRecord::parse(kv.value()).map(|r| (r.instance, r.endpoints));
                    tracing::error!(
                        node = %self.record.node_id,
                        written = ?other,
                        "cluster: this daemon's record was overwritten in etcd (another daemon with this node_id, or a writer that should not have access); registering again"
                    );
                    return Err(ClusterError::Config(
                        "this daemon's record was overwritten in etcd: registering again".into(),
                    ));
                }
            }
            EventType::Put => {
                let Some(r) = self.parse(kv.key(), kv.value()) else {
                    return Ok(());
                };
                if r.node_id == self.record.node_id && r.instance != self.record.instance {
                    tracing::error!(
                        node = %r.node_id,
                        other_endpoints = ?r.endpoints,
                        "cluster: another daemon registered this daemon's node id; give each daemon its own node_id"
                    );
                }
                let (id, eps, v, p) = (
                    r.node_id.clone(),
                    r.endpoints.clone(),
                    r.version.clone(),
                    r.peer_protocol,
                );
                match self.view.upsert(r) {
                    Change::Joined => {
                        tracing::info!(node = %id, endpoints = ?eps, version = %v, peer_protocol = p, "cluster: member joined");
                    }
                    Change::Moved { from } => {
                        tracing::info!(node = %id, endpoints = ?eps, was = ?from, "cluster: member moved; its old endpoints are no longer authorized");
                    }
                    Change::Restarted => {
                        tracing::info!(node = %id, endpoints = ?eps, "cluster: member restarted");
                    }
                    Change::Updated => tracing::debug!(node = %id, "cluster: member updated"),
                }
            }
            EventType::Delete => {
                let Some(id) = self.node_of(kv.key()) else {
                    return Ok(());
                };
                if let Some(r) = self.view.remove(&id) {
                    tracing::info!(node = %id, endpoints = ?r.endpoints, "cluster: member left (lease expired or revoked)");
                }
                if id == self.record.node_id {
                    return Err(ClusterError::Config(
                        "this daemon's record was deleted from etcd: registering again".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    fn node_of(&self, key: &[u8]) -> Option<String> {
        let k = std::str::from_utf8(key).ok()?;
        let id = k.strip_prefix(&self.prefix)?;
        crate::config::valid_node_id(id).then(|| id.to_owned())
    }

    /// A record whose node id matches its key, else `None` (logged).
    fn parse(&self, key: &[u8], value: &[u8]) -> Option<MemberRecord> {
        let id = self.node_of(key);
        match (id, MemberRecord::parse(value)) {
            (Some(id), Some(r)) if r.node_id == id => Some(r),
            _ => {
                tracing::warn!(
                    key = %String::from_utf8_lossy(key),
                    "cluster: ignoring a key under the members prefix that is not a member record"
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn prefix_end_is_the_first_key_past_the_prefix() {
        assert_eq!(
            super::prefix_end("/kvnode/clusters/a/members/"),
            b"/kvnode/clusters/a/members0"
        );
        assert_eq!(super::prefix_end("a\u{7f}"), b"a\x80");
    }
}
