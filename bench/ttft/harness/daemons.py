"""Start and stop real kvnode daemons (`kvnode serve`) for a run; each logs to its own file."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import List, Optional


class DaemonError(RuntimeError):
    pass


def find_bin(explicit: Optional[str] = None) -> str:
    b = explicit or os.environ.get("KVNODE_BIN")
    if not b:
        raise DaemonError("set KVNODE_BIN (or --kvnode-bin) to the kvnode daemon binary")
    if not (os.path.isfile(b) and os.access(b, os.X_OK)):
        raise DaemonError(f"kvnode binary {b!r} is missing or not executable")
    return b


@dataclass
class Daemon:
    name: str
    bin: str
    workdir: str
    dram: str = "1GiB"
    spill_dir: Optional[str] = None
    spill_size: Optional[str] = None
    peer_listen: Optional[str] = None     # host:port
    cluster_key: Optional[str] = None     # file
    peers: List[str] = field(default_factory=list)
    extra: List[str] = field(default_factory=list)
    wrap: List[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]: run inside it
    proc: Optional[subprocess.Popen] = None

    @property
    def sock(self) -> str:
        return os.path.join(self.workdir, f"{self.name}.sock")

    @property
    def log(self) -> str:
        return os.path.join(self.workdir, f"{self.name}.log")

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.peer_listen}" if self.peer_listen else ""

    def args(self) -> List[str]:
        a = [self.bin, "serve", "--socket", self.sock, "--dram", self.dram]
        if self.spill_dir:
            a += ["--spill-dir", self.spill_dir, "--spill-size", self.spill_size or "8GiB"]
        if self.peer_listen:
            a += ["--peer-listen", self.peer_listen, "--advertise", self.endpoint]
            if self.cluster_key:
                a += ["--cluster-key", self.cluster_key]
            else:
                # Keyless listeners serve every local user: the daemon wants it said.
                a += ["--peer-keyless-serves-every-local-user"]
            if self.peers:
                a += ["--peers", ",".join(self.peers)]
        return a + self.extra

    def start(self, timeout_s: float = 60.0) -> "Daemon":
        os.makedirs(self.workdir, exist_ok=True)
        if self.spill_dir:
            os.makedirs(self.spill_dir, exist_ok=True)
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(self.wrap + self.args(), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None:
                raise DaemonError(f"daemon {self.name} exited with {self.proc.returncode}: {self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise DaemonError(f"daemon {self.name} made no socket in {timeout_s}s: {self.tail()}")
            time.sleep(0.05)
        return self

    def tail(self, n: int = 2000) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def write_cluster_key(path: str) -> str:
    with open(path, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    os.chmod(path, 0o600)
    return path
