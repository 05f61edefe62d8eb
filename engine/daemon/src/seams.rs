//! A daemon built with the test seams serves only when the test harness says so.
//!
//! `cargo build --release --workspace` (or any build that also builds the test crate) turns
//! on the `test-seams` feature of the engine by feature unification, and that daemon then
//! obeys `KVNODE_TEST_FAKE_GPU` (any client reads and writes files as the daemon's uid
//! through the fake GPU), fault-injection config sections and the test panic hook. Such a
//! binary looks like any other: a check before packaging can be skipped, so the binary itself
//! refuses to serve unless [`SWITCH_ENV`]` = 1`, which only the test harness
//! (`tests/src/lib.rs`) and the developer tasks that run tests (`cargo xtask`) set. A daemon
//! built with `cargo build --release -p kvnode` has no seams and ignores the variable.

/// The switch a seam build needs to serve.
pub const SWITCH_ENV: &str = "KVNODE_TEST_SEAMS";

/// Why `serve` refuses.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SeamsError {
    /// A seam build started without the switch.
    #[error(
        "this kvnode was built with the test seams (feature `test-seams`: fake GPU, fault injection, test hooks) and refuses to serve: \
         it is a test build, never one to run or ship. Build the daemon with `cargo build --release -p kvnode` \
         (its own build, not --workspace); tests set {SWITCH_ENV}=1"
    )]
    Unswitched,
}

/// `Err` when this build carries the test seams and [`SWITCH_ENV`] is not `1`.
pub fn refuse_unless_switched() -> Result<(), SeamsError> {
    if !kvnode_engine::TEST_SEAMS {
        return Ok(());
    }
    if std::env::var(SWITCH_ENV).as_deref() == Ok("1") {
        return Ok(());
    }
    Err(SeamsError::Unswitched)
}
