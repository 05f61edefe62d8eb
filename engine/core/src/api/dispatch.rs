//! Request dispatch: each op family goes to the file that handles it.

use std::io;

use kvnode_proto::client::{ErrorCode, Op, Reply, Request};

use super::errors::{error, invalid};
use super::session::Session;

impl Session {
    /// Handles one request whose header is decoded and whose `payload_len` bytes are unread;
    /// answers exactly one reply frame.
    pub async fn handle(&mut self, req: Request, payload_len: u64) -> io::Result<()> {
        let id = req.id;
        // Descriptors are only for `AttachRegion`; any that came with another frame are
        // closed now, so a client cannot make the daemon hold descriptors for it.
        if !matches!(req.op, Op::AttachRegion { .. }) {
            self.io.discard_fds();
        }
        if let Some(refused) = self.tenancy_refusal(&req.op) {
            self.io.skip(payload_len).await?;
            return self.send(id, refused, &[]).await;
        }
        if payload_len > 0 && !matches!(req.op, Op::Put { .. }) {
            self.io.skip(payload_len).await?;
            return self
                .send(id, invalid("only Put carries a payload"), &[])
                .await;
        }
        let reply = match req.op {
            Op::Hello { .. } => invalid("Hello is only valid as the first frame"),
            // Ops that write their own reply (payload bytes follow the header).
            op @ (Op::Put { .. } | Op::Get { .. }) => {
                return self.data_io(id, op, payload_len).await;
            }
            Op::Clear { ns: None } if self.engine.tenants().enabled() && !self.is_operator() => {
                self.clear_own()
            }
            op @ (Op::Register { .. }
            | Op::Alloc { .. }
            | Op::Commit { .. }
            | Op::Abort { .. }
            | Op::Release { .. }
            | Op::Exists { .. }
            | Op::Delete { .. }
            | Op::Touch { .. }
            | Op::Clear { .. }) => self.data_op(op).await,
            Op::Stats => Reply::Stats(Box::new(self.stats_for_caller())),
            Op::Timeouts => Reply::Timeouts(Box::new(self.engine.peers.stats.report())),
            Op::Histograms => self.histograms_for_caller(),
            Op::Cluster => self.engine.cluster_report().map_or_else(
                || {
                    error(
                        ErrorCode::Unsupported,
                        "this daemon runs without cluster membership (start it with --cluster etcd://HOST:PORT/NAME)",
                    )
                },
                |r| Reply::Cluster(Box::new(r)),
            ),
            op @ (Op::Pull { .. } | Op::Wait { .. } | Op::Cancel { .. }) => self.peer_op(op).await,
            Op::Act { ns, keys, hints } => self.act(ns, &keys, &hints).await,
            op @ (Op::AttachRegion { .. }
            | Op::DetachRegion { .. }
            | Op::GetToRegion { .. }
            | Op::PutFromRegion { .. }) => self.region_op(op).await,
            op @ (Op::AttachGpu(_)
            | Op::Offload(_)
            | Op::Onload(_)
            | Op::OnloadAsync(_)
            | Op::OnloadWait { .. }
            | Op::OnloadCancel { .. }
            | Op::OnloadLayerWait { .. }) => self.gpu_op(op).await,
        };
        self.send(id, reply, &[]).await
    }
}
