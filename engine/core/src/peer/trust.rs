//! Who this daemon is and whom it may pull from: the allowlist, the cluster keys (reloadable)
//! and the identity its handshakes carry. [`super::Peers::authorize`] combines these with
//! the listener's address ([`super::wires`]) and cluster membership.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use kvnode_proto::hint::Endpoint;

use super::auth::{Identity, KeyRing};
use super::config::{Allowed, PeerConfig};
use super::error::{ConfigError, PeerError};

/// The allowlist, the cluster keys and this daemon's identity.
#[derive(Debug)]
pub(super) struct Trust {
    allow: Vec<Allowed>,
    /// The cluster keys (`None`: keyless, fixed at start; the keys can be reloaded).
    keys: Option<RwLock<Arc<KeyRing>>>,
    key_file: Option<PathBuf>,
    identity: Identity,
    /// The endpoint this daemon is known by, when it has one.
    me: Option<Endpoint>,
}

impl Trust {
    /// Reads the allowlist and the cluster key file of `cfg`.
    pub(super) fn new(cfg: &PeerConfig) -> Result<Self, PeerError> {
        let keys = cfg
            .cluster_key
            .as_deref()
            .map(KeyRing::load)
            .transpose()?
            .map(|r| RwLock::new(Arc::new(r)));
        let me = cfg
            .advertise
            .as_deref()
            .or_else(|| {
                cfg.listen
                    .as_deref()
                    .filter(|l| !l.starts_with("0.0.0.0") && !l.starts_with("[::]"))
            })
            .and_then(|a| {
                Endpoint::parse(a)
                    .or_else(|_| Endpoint::parse(&format!("tcp://{a}")))
                    .ok()
            });
        Ok(Self {
            allow: cfg.allowlist()?,
            keys,
            key_file: cfg.cluster_key.clone(),
            identity: Identity {
                node: me
                    .as_ref()
                    .map_or_else(|| "unnamed".to_owned(), ToString::to_string),
                advertised: me.clone(),
            },
            me,
        })
    }

    /// The cluster keys in force now, if any.
    pub(super) fn keys(&self) -> Option<Arc<KeyRing>> {
        self.keys
            .as_ref()
            .map(|k| Arc::clone(&k.read().expect("key lock")))
    }

    /// Whether a session derived from key `id` may go on (its key is still held).
    pub(super) fn key_held(&self, id: Option<u64>) -> bool {
        match (self.keys(), id) {
            (Some(r), Some(id)) => r.get(id).is_some(),
            (None, None) => true,
            _ => false,
        }
    }

    /// Reads the key file again and puts its keys in force; on error the keys in force
    /// stay. Returns a line for the log.
    pub(super) fn reload(&self) -> Result<String, PeerError> {
        let (Some(path), Some(lock)) = (self.key_file.as_deref(), self.keys.as_ref()) else {
            return Err(ConfigError::NoKeyFile.into());
        };
        let ring = KeyRing::load(path)?;
        let line = format!(
            "cluster keys reloaded from {}: ids {} (were {})",
            path.display(),
            ring.describe(),
            lock.read().expect("key lock").describe()
        );
        *lock.write().expect("key lock") = Arc::new(ring);
        Ok(line)
    }

    /// This daemon's identity in handshakes.
    pub(super) fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Whether `e` is the endpoint this daemon is known by.
    pub(super) fn names_me(&self, e: &Endpoint) -> bool {
        self.me.as_ref() == Some(e)
    }

    /// Whether an allowlist entry admits `e`.
    pub(super) fn allows(&self, e: &Endpoint) -> bool {
        self.allow.iter().any(|a| a.admits(e))
    }

    /// Whether the allowlist names address ranges (which then bound cluster members too).
    pub(super) fn has_cidrs(&self) -> bool {
        self.allow.iter().any(|a| matches!(a, Allowed::Cidr(..)))
    }

    /// The authentication part of the start-up line.
    pub(super) fn describe(&self, encrypt: bool) -> String {
        let sealing = if encrypt {
            "every frame encrypted (AES-256-GCM)"
        } else {
            "every header encrypted (AES-256-GCM), block bodies in the clear and authenticated by their BLAKE3 hash"
        };
        let auth = match self.keys() {
            Some(r) => format!(
                "cluster key ids {}: peers prove the key in a handshake bound to both daemons; {sealing}",
                r.describe()
            ),
            None => "no cluster key: only loopback peers are served and dialled; frames carry integrity tags, which authenticate nothing without a key".to_owned(),
        };
        format!("{auth}; {} allowlist entries", self.allow.len())
    }
}
