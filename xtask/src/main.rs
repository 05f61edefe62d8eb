//! Developer tasks, mirrored by CI (`.ci/run` calls `./dev test`, which runs `cargo xtask ci`).
//!
//! ```text
//! cargo xtask check        fmt --check, no import loops (scripts/check-import-cycles.py),
//!                          clippy -D warnings (one release profile for everything)
//! cargo xtask test         the whole test suite (unit, property, end-to-end with real daemons,
//!                          then the Python SGLang connector's pytest suite)
//! cargo xtask fuzz-smoke   decoder property tests with many more cases (stable-toolchain fuzzing)
//! cargo xtask bench-smoke  every benchmark but `bench gpu` for a short run (scripts/bench-smoke.sh)
//! cargo xtask release-seams  `cargo build --release -p kvnode` has no test seams
//! cargo xtask deploy       image (Debian packages only), container, manifest, wheel, .deb and
//!                          dashboard tests (tests/deploy/run.sh; docs/deploy.md)
//! cargo xtask ci           all of the above, in that order
//! cargo xtask serve ARGS   build and run `kvnode serve ARGS`
//! ```

use std::process::{Command, ExitCode};
use std::time::Instant;

fn run(what: &str, cmd: &mut Command) -> Result<(), String> {
    eprintln!("xtask: {what}: {cmd:?}");
    let t = Instant::now();
    let status = cmd
        .status()
        .map_err(|e| format!("{what}: cannot start: {e}"))?;
    eprintln!(
        "xtask: {what}: {status} in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn check() -> Result<(), String> {
    run("fmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(
        "import-cycles",
        Command::new("python3").arg("scripts/check-import-cycles.py"),
    )?;
    run(
        "clippy",
        cargo().args([
            "clippy",
            "--release",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )
}

fn test() -> Result<(), String> {
    run(
        "build",
        cargo().args(["build", "--release", "--workspace", "--all-targets"]),
    )?;
    run(
        "test",
        cargo().args(["test", "--release", "--workspace", "--", "--test-threads=2"]),
    )?;
    // The peer suites again with every daemon on the UCX transport (over UCX's TCP
    // transport on loopback: no RDMA device is needed or used).
    run(
        "test-peer-ucx",
        cargo()
            .args(["test", "--release", "-p", "kvnode-e2e"])
            .args([
                "--test",
                "peer",
                "--test",
                "peer_faults",
                "--test",
                "peer_bad_frames",
            ])
            .args(["--test", "peer_spill", "--", "--test-threads=2"])
            .env("KVNODE_E2E_PEER_TRANSPORT", "ucx")
            .env("UCX_TLS", "tcp"),
    )?;
    python_tests()
}

/// The Python connector's tests (real sglang wheel, real daemon) in the venv that
/// `scripts/install-deps.sh` builds; a missing venv or zero collected tests is a failure.
fn python_tests() -> Result<(), String> {
    let venv = std::env::var("KVNODE_PY_VENV").unwrap_or_else(|_| {
        format!(
            "{}/.cache/kvnode-sglang-venv",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let py = format!("{venv}/bin/python");
    if !std::path::Path::new(&py).exists() {
        return Err(format!(
            "{py} missing: run scripts/install-deps.sh to build the Python test venv"
        ));
    }
    let path = format!("{venv}/bin:{}", std::env::var("PATH").unwrap_or_default());
    // Absolute: the TTFT harness runs its daemons from another directory.
    let bin = std::env::current_dir()
        .map_err(|e| e.to_string())?
        .join("target/release/kvnode");
    run(
        "python-tests",
        Command::new(&py)
            .args(["-m", "pytest", "-q", "clients/python/tests"])
            .env("PATH", &path)
            .env("KVNODE_BIN", &bin),
    )?;
    // The vLLM connector against the real vllm wheel (its own venv: vllm pins another torch).
    let vllm_venv = std::env::var("KVNODE_VLLM_VENV").unwrap_or_else(|_| {
        format!(
            "{}/.cache/kvnode-vllm-venv",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    run(
        "vllm-tests",
        Command::new(format!("{vllm_venv}/bin/python"))
            .args(["-m", "pytest", "-q", "clients/python/tests_vllm"])
            .env("KVNODE_BIN", &bin),
    )?;
    // The TTFT harness's CPU parts (workload, decoder, report, a tiny end-to-end run with
    // real daemons), so the GPU benchmark does not rot (bench/ttft/README.md).
    run(
        "ttft-harness",
        Command::new(&py)
            .args(["-m", "pytest", "-q", "bench/ttft/tests"])
            .env("PATH", &path)
            .env("KVNODE_BIN", &bin),
    )
}

fn fuzz_smoke() -> Result<(), String> {
    // cargo-fuzz needs a nightly toolchain; CI has stable only, so the same decoders are
    // driven by proptest with a larger case count. `fuzz/` holds the cargo-fuzz targets.
    for (krate, test) in [
        ("kvnode-proto", "frame_decoders"),
        ("kvnode-spill", "decoders"),
    ] {
        run(
            "fuzz-smoke",
            cargo()
                .args(["test", "--release", "-p", krate, "--test", test])
                .env("PROPTEST_CASES", "5000"),
        )?;
    }
    run(
        "fuzz-smoke",
        cargo()
            .args([
                "test",
                "--release",
                "-p",
                "kvnode-proto",
                "--lib",
                "--",
                "hint",
                "peer",
            ])
            .env("PROPTEST_CASES", "5000"),
    )
}

fn bench_smoke() -> Result<(), String> {
    run(
        "bench-smoke",
        Command::new("bash").arg("scripts/bench-smoke.sh"),
    )
}

/// The daemon as `./dev serve` builds it (`cargo build --release -p kvnode`) carries no test
/// seams: a config that asks for fault injection is refused as an unknown field.
fn release_has_no_seams() -> Result<(), String> {
    run(
        "release-build",
        cargo().args(["build", "--release", "-p", "kvnode"]),
    )?;
    let dir = std::env::temp_dir().join(format!("kvnode-seams-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let cfg = dir.join("seams.toml");
    std::fs::write(&cfg, "[peer]\ndebug_fault = { corrupt_block = 1 }\n")
        .map_err(|e| e.to_string())?;
    let out = Command::new("target/release/kvnode")
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .output()
        .map_err(|e| format!("release-seams: cannot run the daemon: {e}"))?;
    let _ = std::fs::remove_dir_all(&dir);
    let text = String::from_utf8_lossy(&out.stderr);
    if out.status.success() || !text.contains("debug_fault") {
        return Err(format!(
            "release-seams: the release daemon accepted a fault-injection config (status {}): {text}",
            out.status
        ));
    }
    eprintln!("xtask: release-seams: the release daemon refuses debug_fault: ok");
    Ok(())
}

/// The deploy stage: the release binaries, then tests/deploy/run.sh (it builds the image).
fn deploy() -> Result<(), String> {
    run(
        "deploy-build",
        cargo().args(["build", "--release", "-p", "kvnode", "-p", "kvtrace"]),
    )?;
    run("deploy", Command::new("bash").arg("tests/deploy/run.sh"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("check") => check(),
        Some("test") => test(),
        Some("fuzz-smoke") => fuzz_smoke(),
        Some("bench-smoke") => bench_smoke(),
        Some("release-seams") => release_has_no_seams(),
        Some("deploy") => deploy(),
        Some("ci") => check()
            .and_then(|()| test())
            .and_then(|()| fuzz_smoke())
            .and_then(|()| bench_smoke())
            .and_then(|()| release_has_no_seams())
            .and_then(|()| deploy()),
        Some("serve") => run(
            "serve",
            cargo()
                .args(["run", "--release", "-p", "kvnode", "--", "serve"])
                .args(&args[1..]),
        ),
        _ => Err("usage: cargo xtask check|test|fuzz-smoke|bench-smoke|ci|serve [ARGS]".into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
