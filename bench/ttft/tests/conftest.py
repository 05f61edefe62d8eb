"""Test set-up for the TTFT harness (CPU only): import paths and the daemon binary.

Run from the repository root:  KVNODE_BIN=/path/to/kvnode python -m pytest bench/ttft/tests
The tests that start real daemons FAIL when KVNODE_BIN is unset or not executable, unless
TTFT_TESTS_NO_DAEMON=1 says skipping them is intended (documented opt-out).
"""

import os
import sys

# Triton kernels (harness/paged_attn.py) run in Triton's CPU interpreter here; it is read when
# a kernel is defined, so it must be set before the harness is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: the toy decoder's ops are tiny, and on a busy 2-core CI machine torch's
# spinning worker threads make them 10-100x slower than one thread.
torch.set_num_threads(int(os.environ.get("TTFT_TORCH_THREADS", "1")))

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
for p in (os.path.join(ROOT, "clients", "python"), os.path.join(ROOT, "bench", "ttft")):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture
def kvnode_bin():
    b = os.environ.get("KVNODE_BIN")
    if not b or not os.access(b, os.X_OK):
        if os.environ.get("TTFT_TESTS_NO_DAEMON") == "1":
            pytest.skip("TTFT_TESTS_NO_DAEMON=1: daemon tests skipped on purpose")
        pytest.fail(f"KVNODE_BIN={b!r} is not an executable kvnode binary "
                    "(set TTFT_TESTS_NO_DAEMON=1 to skip daemon tests on purpose)")
    return b


@pytest.fixture
def daemon(kvnode_bin, tmp_path):
    from harness.daemons import Daemon
    d = Daemon("t", kvnode_bin, str(tmp_path), dram="64MiB").start()
    yield d
    d.stop()
