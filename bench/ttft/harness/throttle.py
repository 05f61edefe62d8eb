"""Slow paths made on this host for the fetch-plan arms (issue 41).

A throttled link for the slow-peer arm: a veth pair whose far end lives in its own
network namespace, each end shaped by `tc tbf` to `rate`. The source daemon runs inside the
namespace (`Daemon.wrap`), listening on the far address; the pulling daemon dials it through
the shaped pair. Unix sockets are files, so workers reach both daemons as usual.

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and `ip`/`tc` (iproute2). `up` raises ThrottleError
with the failing command's output when the host refuses; the run then reports the arm skipped
and why, instead of pretending.

A throttled disk for the slow-disk mixed arm: `DiskThrottle`, a cgroup read-rate limit on the
disk under the spill dir for the NVMe daemon's pid (below).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional


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


def disk_of(path: str) -> str:
    """`MAJ:MIN` of the whole disk holding `path` (a partition's parent). Raises ThrottleError
    where the file system sits on no block device (tmpfs, overlayfs, NFS)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ThrottleError(f"stat {path}: {e}") from e
    maj, mn = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dir = f"/sys/dev/block/{maj}:{mn}"
    if not os.path.exists(sys_dir):
        raise ThrottleError(f"{path} is on device {maj}:{mn}, which is no block device (tmpfs or overlay?)")
    if os.path.exists(os.path.join(sys_dir, "partition")):
        try:
            with open(os.path.join(sys_dir, "..", "dev")) as f:
                return f.read().strip()
        except OSError as e:
            raise ThrottleError(f"parent disk of partition {maj}:{mn}: {e}") from e
    return f"{maj}:{mn}"


def _read(p: str) -> str:
    try:
        with open(p) as f:
            return f.read()
    except OSError:
        return ""


def _write(p: str, s: str) -> None:
    with open(p, "w") as f:
        f.write(s)


class DiskThrottle:
    """A read-rate limit on the disk under `path` for process `pid` (and its threads), as
    tests/src/throttle.rs does for the e2e tests: a new cgroup with cgroup v1's
    `blkio.throttle.read_bps_device` ("MAJ:MIN BYTES") or v2's `io.max` ("MAJ:MIN rbps=BYTES"),
    the pid moved into it. Reads the disk serves to the process (O_DIRECT, io_uring, and
    page-cache misses) are held to `read_bps`; cached pages and writes are not limited.

    `up()` (or `with`) raises ThrottleError when the host cannot do it (no root, no blkio/io
    controller, a path on tmpfs or overlay), leaving nothing behind. `down()` removes the
    limit, moves the pid (and anything it started meanwhile) back to the cgroup it came from
    (read from /proc/PID/cgroup before the move) and removes the cgroup.
    """

    def __init__(self, pid: int, path: str, read_bps: float, root: str = "/sys/fs/cgroup"):
        self.pid, self.path, self.read_bps, self.root = int(pid), path, int(read_bps), root
        self.dev: Optional[str] = None
        self.dir: Optional[str] = None
        self.orig: Optional[str] = None
        self.v2 = False
        self.read_bytes_before: Optional[int] = None

    # -- set-up ----------------------------------------------------------------------------
    def _hierarchy(self) -> str:
        """The cgroup mount to use (v1 blkio first, as throttle.rs); sets `v2`."""
        v1 = os.path.join(self.root, "blkio")
        if os.path.exists(os.path.join(v1, "blkio.throttle.read_bps_device")):
            self.v2 = False
            return v1
        ctl = _read(os.path.join(self.root, "cgroup.controllers")).split()
        if "io" not in ctl:
            raise ThrottleError(f"no blkio (cgroup v1) or io (cgroup v2) controller under {self.root}")
        self.v2 = True
        if "io" not in _read(os.path.join(self.root, "cgroup.subtree_control")).split():
            try:
                _write(os.path.join(self.root, "cgroup.subtree_control"), "+io")
            except OSError as e:
                raise ThrottleError(f"enabling the io controller in {self.root}: {e}") from e
        return self.root

    def _origin(self, mount: str) -> str:
        """The pid's cgroup directory in `mount`'s hierarchy, from /proc/PID/cgroup."""
        text = _read(f"/proc/{self.pid}/cgroup")
        if not text:
            raise ThrottleError(f"process {self.pid} is gone (no /proc/{self.pid}/cgroup)")
        for line in text.splitlines():
            hid, ctls, rel = line.split(":", 2)
            if (self.v2 and hid == "0" and ctls == "") or (not self.v2 and "blkio" in ctls.split(",")):
                d = os.path.normpath(os.path.join(mount, rel.lstrip("/")))
                if os.path.isfile(os.path.join(d, "cgroup.procs")):
                    return d
                break
        return mount  # outside this namespace's view: back to its root

    def up(self) -> "DiskThrottle":
        self.dev = disk_of(self.path)
        mount = self._hierarchy()
        self.orig = self._origin(mount)
        self.dir = os.path.join(mount, f"kvnode-ttft-throttle-{os.getpid()}-{self.pid}")
        try:
            os.mkdir(self.dir)
        except OSError as e:
            self.dir = None
            raise ThrottleError(f"creating a cgroup under {mount}: {e}") from e
        try:
            self.read_bytes_before = self.read_bytes()
            self._set(self.read_bps)
            _write(os.path.join(self.dir, "cgroup.procs"), str(self.pid))
            if str(self.pid) not in _read(os.path.join(self.dir, "cgroup.procs")).split():
                raise ThrottleError(f"pid {self.pid} did not move into {self.dir}")
            if self.limit() != self.read_bps:
                raise ThrottleError(f"the limit did not stick: {self.limit_file} reads {self.limit_line()!r}")
        except (OSError, ThrottleError) as e:
            self.down()
            raise e if isinstance(e, ThrottleError) else ThrottleError(f"throttling pid {self.pid}: {e}") from e
        return self

    def __enter__(self) -> "DiskThrottle":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- the limit -------------------------------------------------------------------------
    @property
    def limit_file(self) -> str:
        return "io.max" if self.v2 else "blkio.throttle.read_bps_device"

    def line(self, bps: Optional[int]) -> str:
        """What is written to the limit file (`None`: no limit)."""
        if self.v2:
            return f"{self.dev} rbps={'max' if bps is None else bps}"
        return f"{self.dev} {0 if bps is None else bps}"

    def _set(self, bps: Optional[int]) -> None:
        _write(os.path.join(self.dir, self.limit_file), self.line(bps))

    def limit_line(self) -> str:
        """The limit file's line for the disk ('' when none)."""
        if not self.dir:
            return ""
        for ln in _read(os.path.join(self.dir, self.limit_file)).splitlines():
            if ln.split() and ln.split()[0] == self.dev:
                return ln.strip()
        return ""

    def limit(self) -> Optional[int]:
        """The read limit in force, bytes/s (None: none)."""
        f = self.limit_line().split()[1:]
        if self.v2:
            f = [t[5:] for t in f if t.startswith("rbps=")]
        return int(f[0]) if f and f[0] not in ("max", "0") else None

    def read_bytes(self) -> Optional[int]:
        """Bytes the cgroup has read from the disk so far (v1 `blkio.throttle.io_service_bytes`,
        v2 `io.stat`)."""
        if not self.dir:
            return None
        if self.v2:
            for ln in _read(os.path.join(self.dir, "io.stat")).splitlines():
                f = ln.split()
                if f and f[0] == self.dev:
                    return next((int(x[7:]) for x in f[1:] if x.startswith("rbytes=")), 0)
            return 0
        for ln in _read(os.path.join(self.dir, "blkio.throttle.io_service_bytes")).splitlines():
            f = ln.split()
            if len(f) == 3 and f[0] == self.dev and f[1] == "Read":
                return int(f[2])
        return 0

    def describe(self) -> Dict:
        rb = self.read_bytes()
        return {"read_bps": self.read_bps, "path": self.path, "device": self.dev, "cgroup": self.dir,
                "cgroup_version": 2 if self.v2 else 1, "limit_file": self.limit_file,
                "limit_line": self.limit_line(), "origin": self.orig,
                "read_bytes": None if rb is None else rb - (self.read_bytes_before or 0)}

    # -- tear-down -------------------------------------------------------------------------
    def down(self) -> None:
        if not self.dir:
            return
        try:
            self._set(None)
        except OSError:
            pass
        back = os.path.join(self.orig or os.path.dirname(self.dir), "cgroup.procs")
        for _ in range(3):
            left = _read(os.path.join(self.dir, "cgroup.procs")).split()
            if not left:
                break
            for p in left:
                try:
                    _write(back, p)
                except OSError:
                    pass  # exited meanwhile
        try:
            os.rmdir(self.dir)
        except OSError:
            time.sleep(0.1)
            try:
                os.rmdir(self.dir)
            except OSError:
                pass
        self.dir = None
