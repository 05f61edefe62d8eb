//! The floor under a pulled page's latency: the same four socket hops a pull through a
//! daemon takes, with nothing else. A client thread asks a relay thread (the destination
//! daemon), which asks a server thread (the source) for `page` bytes over loopback TCP,
//! receives them and answers the client with a short reply (as a `Get` in lease mode does:
//! the client reads the page through its mapping). Each hop is a wake-up of a thread
//! blocked in `read`, which on a small VM costs tens of microseconds when the thread is on
//! another vCPU: the floor is measured in the same run as the pull, on the same machine.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;

use hdrhistogram::Histogram;

/// Bytes of each request and reply.
const SMALL: usize = 64;

fn connected(l: &TcpListener) -> anyhow::Result<(TcpStream, TcpStream)> {
    let a = TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    for s in [&a, &b] {
        s.set_nodelay(true)?;
    }
    Ok((a, b))
}

/// Microsecond latencies of `samples` client requests, each relayed for one `page`-byte
/// answer, after `samples / 10` untimed ones.
pub fn floor(page: usize, samples: usize) -> anyhow::Result<Histogram<u64>> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let (mut client, mut relay_in) = connected(&l)?;
    let (mut relay_out, mut server) = connected(&l)?;
    let warm = samples / 10;
    let total = warm + samples;
    let source = thread::spawn(move || -> std::io::Result<()> {
        let body = vec![0x5au8; page];
        let mut req = [0u8; SMALL];
        for _ in 0..total {
            server.read_exact(&mut req)?;
            server.write_all(&body)?;
        }
        Ok(())
    });
    let relay = thread::spawn(move || -> std::io::Result<()> {
        let mut slot = vec![0u8; page];
        let mut req = [0u8; SMALL];
        for _ in 0..total {
            relay_in.read_exact(&mut req)?;
            relay_out.write_all(&req)?;
            relay_out.read_exact(&mut slot)?;
            relay_in.write_all(&req)?;
        }
        Ok(())
    });
    let mut h = Histogram::<u64>::new(3)?;
    let mut buf = [0u8; SMALL];
    for i in 0..total {
        let t = std::time::Instant::now();
        client.write_all(&buf)?;
        client.read_exact(&mut buf)?;
        if i >= warm {
            h.record(t.elapsed().as_micros().max(1) as u64)?;
        }
    }
    for t in [source, relay] {
        t.join()
            .map_err(|_| anyhow::anyhow!("relay thread panicked"))??;
    }
    Ok(h)
}

/// How this machine's idle CPUs wait, which sets what a wake-up on another CPU costs: the
/// cpuidle driver and, in a KVM guest with the haltpoll driver, how long an idle vCPU polls
/// before it halts (0: it halts at once, and each wake-up of it is an exit to the host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdlePath {
    /// `/sys/devices/system/cpu/cpuidle/current_driver` (`None`: no cpuidle).
    pub driver: Option<String>,
    /// `guest_halt_poll_ns` of the haltpoll governor (`None`: not loaded).
    pub halt_poll_ns: Option<u64>,
}

impl IdlePath {
    /// Reads both from sysfs.
    pub fn read() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
        Self {
            driver: read("/sys/devices/system/cpu/cpuidle/current_driver"),
            halt_poll_ns: read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
                .and_then(|s| s.parse().ok()),
        }
    }

    /// One line for a report.
    pub fn describe(&self) -> String {
        let driver = self.driver.as_deref().unwrap_or("none");
        match self.halt_poll_ns {
            Some(0) => format!(
                "idle CPUs: cpuidle driver {driver}, guest_halt_poll_ns 0 (an idle vCPU halts at once: every wake-up of a thread on it is an exit to the host; docs/operations.md)"
            ),
            Some(ns) => format!(
                "idle CPUs: cpuidle driver {driver}, guest_halt_poll_ns {ns} (an idle vCPU polls up to {} us before it halts)",
                ns / 1000
            ),
            None => format!("idle CPUs: cpuidle driver {driver}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_sample_is_timed_and_positive() {
        let h = super::floor(64 << 10, 50).unwrap();
        assert_eq!(h.len(), 50);
        assert!(h.min() >= 1 && h.value_at_quantile(0.5) < 1_000_000);
    }

    #[test]
    fn the_idle_line_names_the_driver_and_says_whether_idle_vcpus_poll() {
        let at = |driver: Option<&str>, ns| super::IdlePath {
            driver: driver.map(str::to_owned),
            halt_poll_ns: ns,
        };
        let off = at(Some("haltpoll"), Some(0)).describe();
        assert!(
            off.contains("haltpoll") && off.contains("halts at once"),
            "{off}"
        );
        let on = at(Some("haltpoll"), Some(200_000)).describe();
        assert!(on.contains("polls up to 200 us"), "{on}");
        assert_eq!(at(None, None).describe(), "idle CPUs: cpuidle driver none");
        // Whatever this machine has, reading it does not fail.
        assert!(
            super::IdlePath::read()
                .describe()
                .starts_with("idle CPUs: ")
        );
    }
}
