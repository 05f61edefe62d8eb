//! Asking a source which pages it announced under router hashes (`Resolve`,
//! docs/peer-protocol.md), on a connection of its own. A destination that knows blocks only
//! as a router does, by the hashes of the KV events (a router's prefetch at placement,
//! `crate::router`), learns the keys to pull; the pull then goes the usual way.

use kvnode_proto::hint::Endpoint;
use kvnode_proto::peer::{MAX_PULL_KEYS, PeerMsg};
use kvnode_proto::pull::Failure;
use kvnode_proto::{Digest, NamespaceId};

use super::Peers;
use super::error::{PeerError, Violation};

impl Peers {
    /// For each router hash, the page digest `source` announced under it in namespace `ns`
    /// (`None`: it holds no such page, or does not announce it). `source` is authorized as
    /// a hint's endpoint is: nothing is dialled for a peer this daemon does not trust.
    pub async fn resolve(
        &self,
        source: &Endpoint,
        ns: NamespaceId,
        hashes: &[u64],
    ) -> Result<Vec<Option<Digest>>, Failure> {
        self.authorize(source)?;
        self.resolve_on_a_connection(source, ns, hashes)
            .await
            .map_err(|e| e.failure())
    }

    async fn resolve_on_a_connection(
        &self,
        source: &Endpoint,
        ns: NamespaceId,
        hashes: &[u64],
    ) -> Result<Vec<Option<Digest>>, PeerError> {
        let mut w = self.dial_authenticated(source).await?;
        let io = self.io_timeout();
        let mut out = Vec::with_capacity(hashes.len());
        for (req, chunk) in (1u64..).zip(hashes.chunks(MAX_PULL_KEYS)) {
            let ask = PeerMsg::Resolve {
                req,
                ns,
                hashes: chunk.to_vec(),
            };
            w.send(&ask, &[], io).await?;
            match w.recv(io).await?.0 {
                PeerMsg::Resolved { req: r, digests }
                    if r == req && digests.len() == chunk.len() =>
                {
                    out.extend(digests);
                }
                PeerMsg::Resolved { req: r, digests } => {
                    return Err(Violation::ResolveAnswer {
                        req: r,
                        got: digests.len(),
                        want_req: req,
                        want: chunk.len(),
                    }
                    .into());
                }
                other => {
                    return Err(Violation::FromSource {
                        got: Box::new(other),
                    }
                    .into());
                }
            }
        }
        Ok(out)
    }
}
