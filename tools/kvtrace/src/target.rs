//! Preflight checks (privileges, uprobe/tracefs) and finding the kvnode daemons to trace.

use std::path::Path;

use anyhow::{Context, bail};
use kvnode_proto::obs::OP_DONE_X86_ARGS;

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

fn cap_eff() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// Fails with what to do when BPF cannot work here.
pub fn preflight() -> anyhow::Result<()> {
    let caps = cap_eff();
    let has = |c: u32| caps & (1 << c) != 0;
    if !(has(CAP_SYS_ADMIN) || has(CAP_BPF) && has(CAP_PERFMON)) {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        bail!(
            "kvtrace needs root or CAP_BPF + CAP_PERFMON to load BPF programs (running as uid \
             {uid} without them): run it with sudo, or grant them once with \
             `sudo setcap cap_bpf,cap_perfmon+ep $(command -v kvtrace)`"
        );
    }
    let pmu = Path::new("/sys/bus/event_source/devices/uprobe/type").exists();
    let tracefs = [
        "/sys/kernel/tracing/uprobe_events",
        "/sys/kernel/debug/tracing/uprobe_events",
    ]
    .iter()
    .any(|p| Path::new(p).exists());
    if !pmu && !tracefs {
        bail!(
            "this kernel has no uprobe PMU and tracefs is not mounted, so USDT probes cannot be \
             attached: mount it with `sudo mount -t tracefs nodev /sys/kernel/tracing` and retry"
        );
    }
    Ok(())
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn exe_contains(pid: u32, needle: &[u8]) -> anyhow::Result<bool> {
    let exe = std::fs::read(format!("/proc/{pid}/exe"))
        .with_context(|| format!("reading the executable of pid {pid}"))?;
    Ok(exe.windows(needle.len()).any(|w| w == needle))
}

/// Whether the executable of `pid` carries kvnode's USDT notes.
fn has_probes(pid: u32) -> anyhow::Result<bool> {
    exe_contains(pid, b"kvnode\0op_start\0")
}

/// Whether the `op_done` note of `pid` puts its arguments in the fixed x86-64 registers
/// ([`OP_DONE_X86_ARGS`]); a daemon built before that passes them wherever the compiler chose.
pub fn op_done_in_fixed_regs(pid: u32) -> anyhow::Result<bool> {
    if !cfg!(target_arch = "x86_64") {
        return Ok(false);
    }
    exe_contains(
        pid,
        format!("kvnode\0op_done\0{OP_DONE_X86_ARGS}\0").as_bytes(),
    )
}

/// Validates `--pid`.
pub fn check_pid(pid: u32) -> anyhow::Result<()> {
    if !Path::new(&format!("/proc/{pid}")).exists() {
        bail!("no process with pid {pid}");
    }
    if !has_probes(pid)? {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        bail!(
            "pid {pid} is `{}` ({}): not a kvnode daemon (its executable has no kvnode USDT probes)",
            comm(pid),
            exe.display()
        );
    }
    Ok(())
}

/// Every `kvnode serve` process.
pub fn find_daemons() -> anyhow::Result<Vec<u32>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").context("listing /proc")? {
        let Some(pid) = e?.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if comm(pid) != "kvnode" {
            continue;
        }
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if cmd.split(|b| *b == 0).nth(1) == Some(b"serve".as_slice()) && has_probes(pid)? {
            out.push(pid);
        }
    }
    if out.is_empty() {
        bail!(
            "no running kvnode daemon found (looked for `kvnode serve` processes): start one or pass --pid"
        );
    }
    out.sort_unstable();
    Ok(out)
}
