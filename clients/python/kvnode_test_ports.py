"""Loopback ports for the Python tests' daemons (not part of the `kvnode` package).

A port from binding port 0 is free only until the kernel hands it out again, to any bind of
port 0 or any outgoing connection (torch's gloo, UCX and every client dial from that range), so
a daemon started later can find its peer port taken. Ports are taken below the kernel's
ephemeral range (`net.ipv4.ip_local_port_range`), which the kernel never hands out: each
process walks its own sequence of them, seeded by its pid, and returns the first one nothing
holds, never the same one twice. The Rust tests' `free_port` (tests/src/lib.rs) does the same.
"""

import itertools
import os
import socket

_LOW = 10_000
_STEP = 7_919  # prime: with a span not a multiple of it, the walk visits every port once
_next = itertools.count()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds, below the ephemeral range."""
    high = max(_ephemeral_low(), _LOW + 2_000)
    span = high - _LOW
    if span % _STEP == 0:
        span -= 1
    seed = (os.getpid() * 2_654_435_761) % span
    for _ in range(span):
        port = _LOW + (seed + (next(_next) % span) * _STEP) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}..{high}")
