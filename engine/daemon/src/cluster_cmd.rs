//! `kvnode cluster members|status`: the daemon's view of the cluster, over its socket.

use std::fmt::Write as _;

use anyhow::Context;
use kvnode_client::Client;
use kvnode_proto::cluster::{ClusterReport, ClusterSummary};
use kvnode_proto::size::ByteSize;

use crate::cli::{ClusterCmdArgs, ClusterWhat};

pub fn run(a: &ClusterCmdArgs) -> anyhow::Result<()> {
    let path = crate::keys::socket(&a.socket);
    let mut c =
        Client::connect(&path).with_context(|| format!("connecting to {}", path.display()))?;
    let r = c.cluster()?;
    let out = match (a.what, a.json) {
        (ClusterWhat::Members, true) => serde_json::to_string_pretty(&r.members)? + "\n",
        (ClusterWhat::Status, true) => serde_json::to_string_pretty(&r.summary)? + "\n",
        (ClusterWhat::Members, false) => members(&r),
        (ClusterWhat::Status, false) => status(&r.summary),
    };
    print!("{out}");
    Ok(())
}

/// One row per live member.
pub fn members(r: &ClusterReport) -> String {
    let mut s = format!(
        "{:<24} {:<28} {:<9} {:>5} {:>10} {:>10} {:>9} {:>8}  {}\n",
        "node", "endpoint", "version", "proto", "dram", "nvme", "lease_s", "seen_s", "note"
    );
    for m in &r.members {
        let cap = |t: &str| {
            m.tiers.iter().find(|x| x.tier == t).map_or_else(
                || "-".to_owned(),
                |x| ByteSize(x.capacity_bytes).to_string(),
            )
        };
        let note = match (m.this_node, m.compatible) {
            (true, _) => "this node",
            (false, false) => "incompatible: hints refused",
            (false, true) => "",
        };
        let _ = writeln!(
            s,
            "{:<24} {:<28} {:<9} {:>5} {:>10} {:>10} {:>9.1} {:>8.1}  {note}",
            m.node_id,
            m.endpoints.join(","),
            m.version,
            m.peer_protocol,
            cap("dram"),
            cap("nvme"),
            m.lease_age_s,
            m.seen_s,
        );
    }
    let _ = writeln!(
        s,
        "{} live members; cluster {}: {}",
        r.members.len(),
        r.summary.name,
        r.summary.state.as_str()
    );
    s
}

/// Health, one field a line.
pub fn status(c: &ClusterSummary) -> String {
    let mut s = String::new();
    let mut row = |k: &str, v: String| {
        let _ = writeln!(s, "{k:<22} {v}");
    };
    row("cluster", c.name.clone());
    row("node", c.node_id.clone());
    row("etcd", c.etcd.join(","));
    row("state", c.state.as_str().to_owned());
    row("etcd_healthy", c.etcd_healthy.to_string());
    row("registered", c.registered.to_string());
    row("membership_in_force", c.in_force.to_string());
    row("members", c.members.to_string());
    row("incompatible_members", c.incompatible_members.to_string());
    row("membership_age_s", format!("{:.1}", c.membership_age_s));
    if let Some(u) = c.unreachable_for_s {
        row("etcd_unreachable_s", format!("{u:.1}"));
    }
    row("ttl_s", c.ttl_s.to_string());
    row("grace_s", format!("{:.1}", c.grace_s));
    row("reconnects", c.reconnects.to_string());
    row("refused_hints", c.refused_hints.to_string());
    if let Some(e) = &c.last_error {
        row("last_error", e.clone());
    }
    s
}
