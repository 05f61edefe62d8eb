//! The same-run physical limit for spill benchmarks: `fio` with io_uring and O_DIRECT.

use std::path::Path;
use std::process::Command;

/// Bytes per second `fio --ioengine=io_uring --direct=1` reaches for sequential `rw`
/// ("read" or "write") of `size` bytes in `bs` blocks at queue depth `qd`, on `dir/fio.dat`.
pub fn bandwidth(dir: &Path, rw: &str, bs: u64, qd: usize, size: u64) -> Result<f64, String> {
    let out = Command::new("fio")
        .args(["--name=kvnode", "--ioengine=io_uring", "--direct=1"])
        .args(["--output-format=terse", "--terse-version=3"])
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={bs}"))
        .arg(format!("--iodepth={qd}"))
        .arg(format!("--size={size}"))
        .arg(format!("--filename={}", dir.join("fio.dat").display()))
        .output()
        .map_err(|e| format!("cannot run fio ({e}); install it with `apt-get install fio`"))?;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let f: Vec<&str> = line.trim().split(';').collect();
    // terse v3: field 6 = read bandwidth KiB/s, field 47 = write bandwidth KiB/s.
    let field = if rw == "read" { 6 } else { 47 };
    let kib: f64 = f
        .get(field)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("unexpected fio output: {line}"))?;
    Ok(kib * 1024.0)
}
