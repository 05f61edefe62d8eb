//! The daemon's panic policy (docs/operations.md, "When the daemon panics"): a panic on any
//! thread ends the process with exit status 101 and a log line, so a supervisor restarts
//! it, instead of leaving a process that is up but serves nobody. The panic is injected on a
//! runtime worker thread (the threads that run requests) through the daemon's test hook
//! `KVNODE_TEST_PANIC_AFTER_MS`.
//! Run: `cargo test --release -p kvnode-e2e --test panic_policy`.

use std::time::Duration;

use kvnode_e2e::Daemon;

#[test]
fn a_panic_on_a_worker_thread_ends_the_daemon_with_status_101_and_a_log_line() {
    let mut d = Daemon::start_env(
        &[("KVNODE_TEST_PANIC_AFTER_MS", "300")],
        &["--dram", "16MiB", "--no-pin"],
    );
    let mut c = d.client();
    let status = d
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("the daemon stayed up after a panic; log:\n{}", d.log()));
    assert_eq!(status.code(), Some(101), "{status}; log:\n{}", d.log());
    let log = d.log();
    assert!(
        log.contains("test panic requested by KVNODE_TEST_PANIC_AFTER_MS"),
        "{log}"
    );
    assert!(log.contains("kvnode panicked; exiting now"), "{log}");
    // The connected client learns at once that the daemon is gone.
    assert!(c.stats().is_err());
}
