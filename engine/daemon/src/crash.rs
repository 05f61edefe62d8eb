//! The daemon's panic policy: a panic anywhere ends the process at once, with a non-zero
//! exit code, so the supervisor (systemd `Restart=on-failure`) starts a consistent daemon.
//!
//! Why not keep serving: request handlers mutate the DRAM tier's index, slot lists and
//! accounting under one lock. A panic half-way through leaves them in a state nothing
//! checks (a std mutex poisons, every later request fails while the process looks alive;
//! with poisoning ignored, slots could be leaked or handed out twice). Neither is
//! detectable from outside, and a daemon that is up but answers nothing is the worst
//! outcome for a fleet. Exiting costs the DRAM contents (blocks already demoted to the
//! spill tier survive the restart) and is visible: the exit status, the log line below,
//! and the supervisor's restart counter.
//!
//! `_exit` rather than `abort`: an abort would dump core, and the core includes the shared
//! arena mapping (tens of GiB on a production node).

/// Exit status after a panic (the code Rust itself uses for a panicking main thread).
pub const PANIC_EXIT_CODE: i32 = 101;

/// Environment variable (test hook, compiled only into test builds: see
/// `kvnode_engine::TEST_SEAMS`): panic on a runtime worker thread this many milliseconds after
/// start-up, to prove the policy against a real process.
pub const TEST_PANIC_ENV: &str = "KVNODE_TEST_PANIC_AFTER_MS";

/// Installs the policy for this process (daemon only; the operator commands keep the
/// default hook).
pub fn install() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        tracing::error!(
            thread = name,
            panic = %info,
            exit_code = PANIC_EXIT_CODE,
            "kvnode panicked; exiting now so the supervisor restarts a consistent daemon (state under a panicking request cannot be trusted)"
        );
        // SAFETY: `_exit` ends the process without running any more of our code.
        unsafe { libc::_exit(PANIC_EXIT_CODE) };
    }));
}

/// The test hook's delay, if set (see [`TEST_PANIC_ENV`]); always `None` in a release build.
pub fn test_panic_delay() -> Option<std::time::Duration> {
    if !kvnode_engine::TEST_SEAMS {
        return None;
    }
    let ms = std::env::var(TEST_PANIC_ENV).ok()?.parse::<u64>().ok()?;
    Some(std::time::Duration::from_millis(ms))
}
