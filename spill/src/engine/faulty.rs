//! Fault-injecting engine for tests: failed, short and torn operations, and crash cut-offs.

use super::{Cqe, IoEngine, Sqe};
use std::io;
use std::time::{Duration, Instant};

/// Which faults a [`super::IoEngineKind::Faulty`] engine injects. Counts are per IO worker
/// (per spill file) and 0-based; every write request counts, including header, payload and
/// summary writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Fail the Nth write with EIO (nothing is written).
    pub fail_write: Option<u64>,
    /// Fail the Nth fsync with EIO.
    pub fail_fsync: Option<u64>,
    /// Fail the Nth read with EIO.
    pub fail_read: Option<u64>,
    /// Every read transfers only half of what was asked (rounded down to 4096 under `O_DIRECT`).
    pub short_reads: bool,
    /// `(n, k)`: the Nth write stores only its first `k` bytes but reports full success.
    pub torn_write: Option<(u64, u64)>,
    /// Crash simulation: only the first N bytes written (counted over all writes in order)
    /// reach the file; the write crossing N keeps its prefix, later writes and fsyncs are
    /// dropped while reporting success.
    pub crash_after_bytes: Option<u64>,
    /// The Nth fsync is held back and submitted only after a later fsync has completed (or
    /// after [`LATE_FSYNC_MAX`]): two regions' seals then finish in the opposite order.
    pub late_fsync: Option<u64>,
}

/// The longest a [`FaultPlan::late_fsync`] is held back, so that a stop never hangs on it.
pub const LATE_FSYNC_MAX: Duration = Duration::from_secs(2);

/// An fsync held back by [`FaultPlan::late_fsync`].
#[derive(Debug)]
struct Held {
    token: u64,
    since: Instant,
    /// A later fsync was submitted with this token; its completion releases the held one.
    after: Option<u64>,
}

/// Wraps another engine and applies a [`FaultPlan`].
#[derive(Debug)]
pub(crate) struct FaultyEngine {
    pub inner: IoEngine,
    plan: FaultPlan,
    direct: bool,
    writes: u64,
    reads: u64,
    fsyncs: u64,
    written: u64,
    synthetic: Vec<Cqe>,
    /// Tokens whose real result must be replaced by a reported length.
    rewrite: Vec<(u64, i32)>,
    held: Option<Held>,
    /// Operations submitted to the inner engine and not yet completed.
    in_flight: usize,
}

impl FaultyEngine {
    pub fn new(inner: IoEngine, plan: FaultPlan, direct: bool) -> Self {
        Self {
            inner,
            plan,
            direct,
            writes: 0,
            reads: 0,
            fsyncs: 0,
            written: 0,
            synthetic: Vec::new(),
            rewrite: Vec::new(),
            held: None,
            in_flight: 0,
        }
    }

    fn cut(&self, n: u64) -> u64 {
        if self.direct { n / 4096 * 4096 } else { n }
    }

    /// Forwards a shortened write that must report `full` bytes, or reports it directly.
    fn partial_write(&mut self, token: u64, sqe: Sqe, keep: u64, full: u32) -> io::Result<()> {
        let keep = self.cut(keep);
        if let (
            Sqe::Write {
                buf, offset, fixed, ..
            },
            true,
        ) = (sqe, keep > 0)
        {
            self.rewrite.push((token, full.cast_signed()));
            let short = Sqe::Write {
                buf,
                len: keep as u32,
                offset,
                fixed,
            };
            return self.submit(token, short);
        }
        self.synthetic.push(Cqe {
            token,
            res: full.cast_signed(),
        });
        Ok(())
    }

    pub fn push(&mut self, token: u64, sqe: Sqe) -> io::Result<()> {
        let crashed = self
            .plan
            .crash_after_bytes
            .is_some_and(|c| self.written >= c);
        match sqe {
            Sqe::Write { len, .. } => {
                let n = self.writes;
                self.writes += 1;
                let start = self.written;
                self.written += u64::from(len);
                if self.plan.fail_write == Some(n) {
                    self.synthetic.push(Cqe {
                        token,
                        res: -libc::EIO,
                    });
                    return Ok(());
                }
                if let Some(crash) = self.plan.crash_after_bytes {
                    if crashed {
                        self.synthetic.push(Cqe {
                            token,
                            res: len.cast_signed(),
                        });
                        return Ok(());
                    }
                    if start + u64::from(len) > crash {
                        return self.partial_write(token, sqe, crash - start, len);
                    }
                }
                if let Some((t, keep)) = self.plan.torn_write
                    && t == n
                    && keep < u64::from(len)
                {
                    return self.partial_write(token, sqe, keep, len);
                }
                self.submit(token, sqe)
            }
            Sqe::Read {
                buf,
                len,
                offset,
                fixed,
            } => {
                let n = self.reads;
                self.reads += 1;
                if self.plan.fail_read == Some(n) {
                    self.synthetic.push(Cqe {
                        token,
                        res: -libc::EIO,
                    });
                    return Ok(());
                }
                if self.plan.short_reads {
                    let half = self.cut(u64::from(len) / 2) as u32;
                    if half == 0 {
                        self.synthetic.push(Cqe { token, res: 0 });
                        return Ok(());
                    }
                    return self.submit(
                        token,
                        Sqe::Read {
                            buf,
                            len: half,
                            offset,
                            fixed,
                        },
                    );
                }
                self.submit(token, sqe)
            }
            Sqe::Fsync => {
                let n = self.fsyncs;
                self.fsyncs += 1;
                if self.plan.fail_fsync == Some(n) {
                    self.synthetic.push(Cqe {
                        token,
                        res: -libc::EIO,
                    });
                    return Ok(());
                }
                if crashed {
                    self.synthetic.push(Cqe { token, res: 0 });
                    return Ok(());
                }
                if self.plan.late_fsync == Some(n) {
                    self.held = Some(Held {
                        token,
                        since: Instant::now(),
                        after: None,
                    });
                    return Ok(());
                }
                if let Some(h) = self.held.as_mut().filter(|h| h.after.is_none()) {
                    h.after = Some(token);
                }
                self.submit(token, sqe)
            }
        }
    }

    fn submit(&mut self, token: u64, sqe: Sqe) -> io::Result<()> {
        self.inner.push(token, sqe)?;
        self.in_flight += 1;
        Ok(())
    }

    fn release_held(&mut self) -> io::Result<()> {
        match self.held.take() {
            Some(h) => self.submit(h.token, Sqe::Fsync),
            None => Ok(()),
        }
    }

    pub fn wait(&mut self, min: usize, out: &mut Vec<Cqe>) -> io::Result<()> {
        if self
            .held
            .as_ref()
            .is_some_and(|h| h.since.elapsed() >= LATE_FSYNC_MAX)
        {
            self.release_held()?;
        }
        let have = self.synthetic.len();
        out.append(&mut self.synthetic);
        let start = out.len();
        let need = min.saturating_sub(have);
        if need > 0 && self.in_flight == 0 && self.held.is_some() {
            // Only the held fsync is outstanding: return nothing, as a wake-up without
            // completions would, so that the worker goes on taking requests.
            std::thread::sleep(Duration::from_millis(1));
            return Ok(());
        }
        self.inner.wait(need, out)?;
        self.in_flight -= out.len() - start;
        let release = self
            .held
            .as_ref()
            .and_then(|h| h.after)
            .is_some_and(|t| out[start..].iter().any(|c| c.token == t));
        if release {
            self.release_held()?;
        }
        for c in &mut out[start..] {
            if let Some(i) = self.rewrite.iter().position(|(t, _)| *t == c.token) {
                let (_, full) = self.rewrite.swap_remove(i);
                if c.res >= 0 {
                    c.res = full;
                }
            }
        }
        Ok(())
    }
}
