//! A daemon built with the test seams cannot be run as a real one (issue 38 item 8). The
//! daemon these tests start is the workspace's test build, which carries the seams by feature
//! unification (the fake GPU behind `KVNODE_TEST_FAKE_GPU` lets any client read and write
//! files as the daemon's uid). Pins: started without `KVNODE_TEST_SEAMS=1` (as systemd or a
//! pod would start a binary that was shipped by mistake) it refuses to serve, says why, and
//! binds nothing, whatever seam its environment asks for.
//! Run: `cargo test --release -p kvnode-e2e --test attack_seams`.

use std::process::{Command, Stdio};
use std::time::Duration;

use kvnode_e2e::{SEAMS_SWITCH, kvnode_bin, kvnode_cmd, temp_dir};

/// This binary is a seam build: with the switch it accepts a fault-injection section.
fn assert_seam_build() {
    let dir = temp_dir("seams-probe");
    let cfg = dir.join("fault.toml");
    std::fs::write(&cfg, "[spill]\ndebug_fault = { fail_write = 1 }\n").unwrap();
    let out = kvnode_cmd()
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("debug_fault"),
        "{} is not a test-seam build (KVNODE_BIN must name the workspace's test build): {}",
        kvnode_bin().display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_seam_build_refuses_to_serve_without_the_test_switch() {
    assert_seam_build();
    for env in [
        &[][..],
        &[("KVNODE_TEST_FAKE_GPU", "0")][..],
        &[(SEAMS_SWITCH.0, "0")][..],
    ] {
        let dir = temp_dir("seams-refused");
        let sock = dir.join("kvnode.sock");
        let log = dir.join("daemon.log");
        let mut child = Command::new(kvnode_bin())
            .env_remove(SEAMS_SWITCH.0)
            .envs(env.iter().copied())
            .args(["serve", "--dram", "16MiB", "--no-pin", "--socket"])
            .arg(&sock)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let status = kvnode_e2e::child_exit(&mut child, Duration::from_secs(10));
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let bound = sock.exists();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            status.is_some_and(|s| !s.success()),
            "the seam build serves without {}=1 (env {env:?}, status {status:?}):\n{text}",
            SEAMS_SWITCH.0
        );
        assert!(text.contains("built with the test seams"), "{text}");
        assert!(text.contains(SEAMS_SWITCH.0), "{text}");
        assert!(!bound, "the refused daemon bound its socket");
    }
}
