//! Developer tasks, mirrored by CI (`.ci/run` calls `./dev test`, which runs `cargo xtask ci`).
//!
//! ```text
//! cargo xtask check        fmt --check, no import loops (scripts/check-import-cycles.py),
//!                          clippy -D warnings (one release profile for everything)
//! cargo xtask test         the whole test suite (unit, property, end-to-end with real daemons,
//!                          then the Python suites: SGLang and vLLM connectors, the real Dynamo
//!                          indexer against the daemon's KV events, TTFT harness, each in the
//!                          venv of its lock, scripts/locks/*.lock via scripts/py-venv.sh)
//! cargo xtask fuzz-smoke   decoder property tests with many more cases (stable-toolchain fuzzing)
//! cargo xtask bench-smoke  every benchmark but `bench gpu` for a short run (scripts/bench-smoke.sh)
//! cargo xtask release-seams [BIN]  the packaged daemon (`cargo build --release -p kvnode
//!                          -p kvtrace` in its own target dir, target/package) has no test
//!                          seams; with BIN, probes that binary only (the packaging scripts)
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

/// The switch a daemon built with the test seams needs to serve (engine/daemon/src/seams.rs).
/// Set for the stages that run the workspace's test build of `target/release/kvnode` (Python
/// suites, bench smoke); never for anything packaged.
const SEAMS_SWITCH: (&str, &str) = ("KVNODE_TEST_SEAMS", "1");

/// Where the packaged binaries are built: a target dir of their own, so the workspace's test
/// build (which turns `test-seams` on by feature unification) never touches them.
const PACKAGE_TARGET: &str = "target/package";

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

/// The venv built from `scripts/locks/ENV.lock` (scripts/py-venv.sh: keyed by the lock's
/// hash, built when missing, and checked to hold exactly the lock every time): its python.
fn locked_python(env: &str) -> Result<String, String> {
    eprintln!("xtask: venv {env}: bash scripts/py-venv.sh {env}");
    let out = Command::new("bash")
        .args(["scripts/py-venv.sh", env])
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("venv {env}: cannot start scripts/py-venv.sh: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.lines().last() {
        Some(py) if out.status.success() && std::path::Path::new(py).exists() => Ok(py.to_string()),
        _ => Err(format!(
            "venv {env}: scripts/py-venv.sh failed ({}): {text}",
            out.status
        )),
    }
}

/// The Python connector's tests (real sglang wheel, real daemon), the vLLM connector's, the
/// Dynamo indexer's (real ai-dynamo-runtime wheel) and the TTFT harness's, each in the venv of
/// its lock; zero collected tests is a failure (pytest 5).
fn python_tests() -> Result<(), String> {
    let py = locked_python("sglang")?;
    let venv_bin = std::path::Path::new(&py)
        .parent()
        .ok_or("venv python has no directory")?
        .to_path_buf();
    let path = format!(
        "{}:{}",
        venv_bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // Absolute: the TTFT harness runs its daemons from another directory.
    let bin = std::env::current_dir()
        .map_err(|e| e.to_string())?
        .join("target/release/kvnode");
    // The seam: idempotent; refuses (exit 2) an sglang other than 0.5.23 or a tree it does not match.
    run(
        "sglang-seam",
        Command::new(&py).args(["-m", "kvnode.sglang", "patch", "--apply"]),
    )?;
    run(
        "python-tests",
        Command::new(&py)
            .args(["-m", "pytest", "-q", "clients/python/tests"])
            .env("PATH", &path)
            .env("KVNODE_BIN", &bin)
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1),
    )?;
    // The vLLM connector against the real vllm wheel (its own venv: vllm pins another torch).
    let vllm_py = locked_python("vllm")?;
    run(
        "vllm-tests",
        Command::new(&vllm_py)
            .args(["-m", "pytest", "-q", "clients/python/tests_vllm"])
            .env("KVNODE_BIN", &bin)
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1),
    )?;
    // The real Dynamo indexer (the ai-dynamo-runtime 1.6.1 wheel, its own small venv: no torch)
    // restarted past the daemon's replay ring ends with exactly the node's blocks
    // (docs/events.md, "Tests and benchmark").
    let dynamo_py = locked_python("dynamo")?;
    run(
        "dynamo-indexer-tests",
        Command::new(&dynamo_py)
            .args(["-m", "pytest", "-q", "clients/python/tests_dynamo"])
            .env("KVNODE_BIN", &bin)
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1),
    )?;
    // The TTFT harness's CPU parts (workload, decoder, report, a tiny end-to-end run with
    // real daemons), so the GPU benchmark does not rot (bench/ttft/README.md). It needs torch,
    // pytest and the kvnode client only, all in the SGLang venv, so it shares that venv and its
    // lock (scripts/locks/sglang.lock) rather than downloading a third torch.
    run(
        "ttft-harness",
        Command::new(&py)
            .args(["-m", "pytest", "-q", "bench/ttft/tests"])
            .env("PATH", &path)
            .env("KVNODE_BIN", &bin)
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1),
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
                "actions",
                "router",
            ])
            .env("PROPTEST_CASES", "5000"),
    )
}

fn bench_smoke() -> Result<(), String> {
    // target/release/kvnode is the workspace's test build here (`cargo xtask test` built it).
    run(
        "bench-smoke",
        Command::new("bash")
            .arg("scripts/bench-smoke.sh")
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1),
    )
}

/// The packaged daemon carries no test seams: `cargo build --release -p kvnode -p kvtrace`
/// in [`PACKAGE_TARGET`] (what scripts/build-image.sh and packaging/deb/build-deb.sh ship),
/// then [`probe_seams`] on it.
fn release_has_no_seams() -> Result<(), String> {
    run(
        "release-build",
        cargo().args([
            "build",
            "--release",
            "-p",
            "kvnode",
            "-p",
            "kvtrace",
            "--target-dir",
            PACKAGE_TARGET,
        ]),
    )?;
    probe_binary(&std::path::Path::new(PACKAGE_TARGET).join("release/kvnode"))
}

/// Probes `bin` for test seams in a scratch directory.
fn probe_binary(bin: &std::path::Path) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("kvnode-seams-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let r = fake_gpu_absent(bin).and_then(|()| probe_seams(bin, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// The fake GPU is a switch too: a seam build started with `KVNODE_TEST_FAKE_GPU` set runs its
/// GPU ops on files (engine/core/src/engine.rs `gpu_hub`, engine/gpu/src/fake.rs). Its only
/// reader is code compiled with `kvnode-gpu/fake` (pulled in by the engine's `test-seams`), and
/// the variable's name is a string constant of that module, so the name occurs in a binary
/// exactly when the switch is compiled in: a seam build of target/release holds it, the
/// packaged build must not. Checked on the file's bytes, not on a log line.
fn fake_gpu_absent(bin: &std::path::Path) -> Result<(), String> {
    const NAME: &[u8] = b"KVNODE_TEST_FAKE_GPU";
    let bytes = std::fs::read(bin)
        .map_err(|e| format!("release-seams: cannot read {}: {e}", bin.display()))?;
    if bytes.windows(NAME.len()).any(|w| w == NAME) {
        return Err(format!(
            "release-seams: {} contains the fake GPU's switch (KVNODE_TEST_FAKE_GPU): it was built with the test seams; build it alone: cargo build --release -p kvnode",
            bin.display()
        ));
    }
    eprintln!(
        "xtask: release-seams: {} holds no fake GPU switch (KVNODE_TEST_FAKE_GPU absent from its bytes): ok",
        bin.display()
    );
    Ok(())
}

/// Every seam a running daemon could be asked for is probed, with the seam switch set (so a
/// seam build shows its seams instead of refusing to start): each `debug_fault` config
/// section (peer transport, spill IO engine) is refused as an unknown field, and the panic
/// hook's environment variable is ignored (the daemon is still serving after it). The fake
/// GPU's switch is checked on the binary's bytes first ([`fake_gpu_absent`]).
fn probe_seams(bin: &std::path::Path, dir: &std::path::Path) -> Result<(), String> {
    for (seam, toml) in [
        ("peer", "[peer]\ndebug_fault = { corrupt_block = 1 }\n"),
        ("spill", "[spill]\ndebug_fault = { fail_write = 1 }\n"),
    ] {
        let cfg = dir.join(format!("{seam}.toml"));
        std::fs::write(&cfg, toml).map_err(|e| e.to_string())?;
        let out = Command::new(bin)
            .args(["serve", "--print-config", "--config"])
            .arg(&cfg)
            .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1)
            .output()
            .map_err(|e| format!("release-seams: cannot run {}: {e}", bin.display()))?;
        let text = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !text.contains("debug_fault") {
            return Err(format!(
                "release-seams: {} accepted a [{seam}] fault-injection config (status {}): it was built with the test seams; build it alone: cargo build --release -p kvnode. {text}",
                bin.display(),
                out.status
            ));
        }
        eprintln!(
            "xtask: release-seams: {} refuses [{seam}] debug_fault: ok",
            bin.display()
        );
    }
    // The panic hook: a test build panics (exit 101) 50 ms after start; a release one serves on.
    // The socket in a directory of its own: the takeover socket's (`sock-admin`) is then
    // inside `dir` too, and goes with it.
    let mut child = Command::new(bin)
        .args(["serve", "--dram", "16MiB", "--no-pin", "--socket"])
        .arg(dir.join("sock/kvnode.sock"))
        .env("KVNODE_TEST_PANIC_AFTER_MS", "50")
        .env(SEAMS_SWITCH.0, SEAMS_SWITCH.1)
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("release-seams: cannot start {}: {e}", bin.display()))?;
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let exited = child.try_wait().map_err(|e| e.to_string())?;
    let _ = child.kill();
    let _ = child.wait();
    if let Some(status) = exited {
        return Err(format!(
            "release-seams: {} ended ({status}) with KVNODE_TEST_PANIC_AFTER_MS set: the panic hook is compiled in",
            bin.display()
        ));
    }
    eprintln!(
        "xtask: release-seams: {} ignores KVNODE_TEST_PANIC_AFTER_MS: ok",
        bin.display()
    );
    Ok(())
}

/// The deploy stage: tests/deploy/run.sh (the image and the .deb build their own seam-free
/// binaries in target/package and probe them; the tests' host-side daemon is that build too).
fn deploy() -> Result<(), String> {
    run("deploy", Command::new("bash").arg("tests/deploy/run.sh"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args.first().map(String::as_str) {
        Some("check") => check(),
        Some("test") => test(),
        Some("fuzz-smoke") => fuzz_smoke(),
        Some("bench-smoke") => bench_smoke(),
        Some("release-seams") => match args.get(1) {
            Some(bin) => probe_binary(std::path::Path::new(bin)),
            None => release_has_no_seams(),
        },
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
        _ => Err(
            "usage: cargo xtask check|test|fuzz-smoke|bench-smoke|release-seams [BIN]|deploy|ci|serve [ARGS]"
                .into(),
        ),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
