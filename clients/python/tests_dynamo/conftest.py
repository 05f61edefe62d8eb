"""Fixtures for the test against the real Dynamo indexer (the `ai-dynamo-runtime` 1.6.1 wheel).

`dynamo` is imported at module level on purpose: where the wheel does not import, collection
fails and the run fails (no skip). The venv is built from scripts/locks/dynamo.lock; run with
`KVNODE_TEST_SEAMS=1 $(bash scripts/py-venv.sh dynamo | tail -1) -m pytest clients/python/tests_dynamo`
(KVNODE_BIN names the daemon, default target/release/kvnode).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import dynamo._core  # noqa: F401  (must import: a missing wheel is a failure, not a skip)
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from kvnode.wire import Connection, wait_for_daemon  # noqa: E402
from kvnode_test_ports import free_port  # noqa: E402

ROOT = HERE.parents[2]


def kvnode_bin() -> str:
    b = os.environ.get("KVNODE_BIN") or str(ROOT / "target" / "release" / "kvnode")
    assert Path(b).exists(), f"{b} not built: run `cargo build --release -p kvnode` or set KVNODE_BIN"
    return b


class Daemon:
    """A real kvnode daemon publishing KV events on ipc sockets, with a spill tier."""

    def __init__(self, tmp: Path, ipc_dir: str, extra: tuple = ()):
        self.socket = str(tmp / "kvnode.sock")
        self.events = f"ipc://{ipc_dir}/ev.sock"
        self.replay = f"ipc://{ipc_dir}/replay.sock"
        (tmp / "spill").mkdir()
        self.log_path = tmp / "daemon.log"
        self.log = open(self.log_path, "w")
        self.argv = [kvnode_bin(), "serve", "--socket", self.socket, "--no-pin", *extra,
                     "--spill-dir", str(tmp / "spill"),
                     "--events", self.events, "--events-replay", self.replay, "--dp-rank", "0"]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=self.log)
        wait_for_daemon(self.socket, self.proc, 10.0, self.log_path)

    def restart(self, limit: float = 60.0):
        """Stops the daemon with SIGTERM (the stop-time flush), then starts it again with
        the same flags on the same spill directory."""
        self.proc.terminate()
        try:
            rc = self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the daemon did not stop in {limit} s: see {self.log_path}")
        assert rc == 0, f"the daemon exited {rc} on SIGTERM: see {self.log_path}"
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=self.log)
        wait_for_daemon(self.socket, self.proc, limit, self.log_path)

    def takeover(self, limit: float = 60.0):
        """Starts a successor with the same flags and `--takeover` (docs/operations.md,
        "Takeover"); returns once the old process exited 0 and the successor answers."""
        old = self.proc
        self.proc = subprocess.Popen([*self.argv, "--takeover"], stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        try:
            rc = old.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the old daemon did not hand over in {limit} s: see {self.log_path}")
        assert rc == 0, f"the old daemon exited {rc}: see {self.log_path}"
        t0 = time.monotonic()
        while True:
            assert self.proc.poll() is None, f"the successor exited {self.proc.returncode}: see {self.log_path}"
            try:
                c = Connection(self.socket)
                if c.stats()["pid"] == self.proc.pid:
                    c.close()
                    return
                c.close()
            except (OSError, ConnectionError):
                pass
            assert time.monotonic() - t0 < limit, f"the successor is not serving: see {self.log_path}"
            time.sleep(0.05)

    def connect(self) -> Connection:
        return Connection(self.socket)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


class Indexer:
    """`python -m dynamo.indexer` (the wheel's standalone indexer, HTTP) as a child process."""

    def __init__(self, log_path: Path):
        self.port = free_port()
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log, stderr=self.log)
        t0 = time.monotonic()
        while True:
            try:
                self.http("/health")
                return
            except (urllib.error.URLError, ConnectionError):
                assert self.proc.poll() is None, f"dynamo.indexer exited ({self.proc.returncode}): see {log_path}"
                assert time.monotonic() - t0 < 30, f"dynamo.indexer not answering after 30 s: see {log_path}"
                time.sleep(0.1)

    def http(self, path: str, body=None):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return json.loads(raw) if raw else None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture
def ipc_dir():
    # Short (a Unix socket path has at most 107 bytes) and private (0700).
    d = tempfile.mkdtemp(prefix="kvdyn-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)
