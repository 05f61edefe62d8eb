"""Fixtures: real kvnode daemons on private sockets (one, or a peer pair with a dead third)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# SGLang JIT-builds its page-hash extension with the venv's `ninja`, found through PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
from kvnode.wire import wait_for_daemon  # noqa: E402
from kvnode_test_ports import free_port  # noqa: E402,F401  (re-exported to the tests)

ROOT = Path(__file__).resolve().parents[3]


def kvnode_bin() -> str:
    b = os.environ.get("KVNODE_BIN") or str(ROOT / "target" / "release" / "kvnode")
    assert Path(b).exists(), f"{b} not built: run `cargo build --release -p kvnode`"
    return b


class Daemon:
    def __init__(self, tmp: Path, dram: str = "512MiB", extra: tuple = ()):
        tmp.mkdir(parents=True, exist_ok=True)
        self.socket = str(tmp / "kvnode.sock")
        self.log = open(tmp / "daemon.log", "w")
        self.proc = subprocess.Popen(
            [kvnode_bin(), "serve", "--socket", self.socket, "--dram", dram, "--slab-size", "4MiB",
             "--no-pin", *extra], stdout=subprocess.DEVNULL, stderr=self.log)
        wait_for_daemon(self.socket, self.proc, 10.0, tmp / "daemon.log")

    def cli(self, *args: str) -> str:
        return subprocess.run([kvnode_bin(), *args, "--socket", self.socket], check=True,
                              capture_output=True, text=True).stdout

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def pair(tmp_path):
    """Daemon A serves peers on a port; daemon B may pull from A and from a port nobody holds.

    Yields (A, A's peer port, B, the dead port).
    """
    pa = free_port()
    a = Daemon(tmp_path / "a", extra=("--peer-listen", f"127.0.0.1:{pa}",
                                      "--advertise", f"tcp://127.0.0.1:{pa}",
                                      "--peer-keyless-serves-every-local-user"))
    dead = free_port()
    b = Daemon(tmp_path / "b", extra=("--peers", f"tcp://127.0.0.1:{pa},tcp://127.0.0.1:{dead}"))
    yield a, pa, b, dead
    a.stop()
    b.stop()
