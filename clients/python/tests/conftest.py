"""Fixtures: a real kvnode daemon on a private socket, and SGLang-shaped shm host pools."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvnode.wire import Connection  # noqa: E402

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
        deadline = time.time() + 10
        while True:
            try:
                Connection(self.socket).close()
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"daemon did not start: {(tmp / 'daemon.log').read_text()}")
                time.sleep(0.02)

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
