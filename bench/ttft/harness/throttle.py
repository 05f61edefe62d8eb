"""A throttled link for the slow-peer arm (issue 41): a veth pair whose far end lives in its own
network namespace, each end shaped by `tc tbf` to `rate`. The source daemon runs inside the
namespace (`Daemon.wrap`), listening on the far address; the pulling daemon dials it through
the shaped pair. Unix sockets are files, so workers reach both daemons as usual.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and `ip`/`tc` (iproute2). `up` raises ThrottleError
with the failing command's output when the host refuses; the run then reports the arm skipped
and why, instead of pretending.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import List


class ThrottleError(RuntimeError):
    pass


@dataclass
class Link:
    ns: str = "kvnode-slowpeer"
    host_if: str = "kvsp-h"
    ns_if: str = "kvsp-n"
    host_addr: str = "10.213.7.1"
    ns_addr: str = "10.213.7.2"
    rate: str = "8gbit"
    burst: str = "4mb"  # >= rate / HZ and >= a GSO packet (64 KiB)

    def _cmds(self) -> List[List[str]]:
        nx = ["ip", "netns", "exec", self.ns]
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
        return [
            ["ip", "netns", "add", self.ns],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.ns],
            ["ip", "addr", "add", f"{self.host_addr}/24", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            nx + ["ip", "addr", "add", f"{self.ns_addr}/24", "dev", self.ns_if],
            nx + ["ip", "link", "set", self.ns_if, "up"],
            nx + ["ip", "link", "set", "lo", "up"],
            ["tc", "qdisc", "add", "dev", self.host_if, "root"] + tbf,
            nx + ["tc", "qdisc", "add", "dev", self.ns_if, "root"] + tbf,
        ]

    @property
    def wrap(self) -> List[str]:
        return ["ip", "netns", "exec", self.ns]

    def up(self) -> "Link":
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise ThrottleError(f"`{tool}` (iproute2) is not installed")
        self.down()
        for c in self._cmds():
            p = subprocess.run(c, capture_output=True, text=True)
            if p.returncode != 0:
                self.down()
                raise ThrottleError(f"`{' '.join(c)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
        return self

    def describe(self) -> dict:
        out = {"rate": self.rate, "burst": self.burst, "ns": self.ns, "far": self.ns_addr}
        for name, c in (("host_qdisc", ["tc", "-s", "qdisc", "show", "dev", self.host_if]),
                        ("ns_qdisc", self.wrap + ["tc", "-s", "qdisc", "show", "dev", self.ns_if])):
            p = subprocess.run(c, capture_output=True, text=True)
            out[name] = (p.stdout or p.stderr).strip()[:600]
        return out

    def down(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
