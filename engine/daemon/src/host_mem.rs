//! How much memory this process can have: the machine's RAM and its cgroup's limit, to warn
//! when `--dram` asks for more than either (the daemon would start and then be OOM-killed,
//! or swap, once the arena fills).

use kvnode_proto::size::ByteSize;

/// `MemTotal` from /proc/meminfo, in bytes.
fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `memory.max` of this process's cgroup (v2), when it sets one.
fn cgroup_limit() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cg.lines().find_map(|l| l.strip_prefix("0::"))?;
    let max = std::fs::read_to_string(format!("/sys/fs/cgroup{}/memory.max", path.trim())).ok()?;
    max.trim().parse().ok()
}

/// Why `dram` bytes cannot fit in this process's memory, or `None` when they can.
pub fn dram_too_large(dram: u64) -> Option<String> {
    let total = mem_total();
    let limit = cgroup_limit();
    let mut why = Vec::new();
    if let Some(t) = total.filter(|&t| dram > t) {
        why.push(format!(
            "this machine has {} of RAM (MemTotal)",
            ByteSize(t)
        ));
    }
    if let Some(l) = limit.filter(|&l| dram > l) {
        why.push(format!(
            "this process's cgroup allows {} (memory.max)",
            ByteSize(l)
        ));
    }
    (!why.is_empty()).then(|| {
        format!(
            "--dram {} is larger than the memory available: {}; the daemon will be OOM-killed or swap once the tier fills: lower --dram",
            ByteSize(dram),
            why.join(" and ")
        )
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn more_than_the_machine_is_reported_and_a_small_tier_is_not() {
        let why = super::dram_too_large(u64::MAX).expect("u64::MAX bytes exceed any machine");
        assert!(why.contains("MemTotal"), "{why}");
        assert_eq!(super::dram_too_large(8 << 20), None);
    }
}
