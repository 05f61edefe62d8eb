"""kvnode.gpu against a real daemon on a machine without CUDA, and its client-side checks."""

import pytest

from kvnode import gpu
from kvnode.wire import Connection, KvnodeError


def layouts_the_daemon_would_refuse_are_refused_before_sending():
    lf = gpu.GpuLayout.layer_first(0, 4, 256, 6)
    lf.validate(6 * 4 * 256)
    assert lf.page_bytes == 6 * 256 and lf.objects[3].offset == 3 * 4 * 256
    with pytest.raises(gpu.LayoutError, match="past the buffer"):
        lf.validate(6 * 4 * 256 - 16)
    with pytest.raises(gpu.LayoutError, match="multiple of 16"):
        gpu.GpuLayout.page_first(8, 4, 4096).validate(1 << 20)
    with pytest.raises(gpu.LayoutError, match="no pages"):
        gpu.GpuLayout.page_first(0, 0, 4096).validate(1 << 20)
    assert gpu.leading(["Loaded", "Loaded", "Miss", "Loaded"]) == 2


def attach_on_a_daemon_without_cuda_answers_no_cuda_driver(daemon):
    c = Connection(daemon.sock)
    g = gpu.GpuClient(c)
    layout = gpu.GpuLayout.page_first(0, 4, 4096)
    with pytest.raises(gpu.LayoutError, match="64 bytes"):
        g.attach(b"\x01" * 63, 0, 4 * 4096, layout)
    with pytest.raises(gpu.LayoutError, match="zeroes"):
        g.attach(b"\x00" * 64, 0, 4 * 4096, layout)
    with pytest.raises(KvnodeError) as e:
        g.attach(b"\x01" * 64, 0, 4 * 4096, layout)
    assert e.value.code == "Unsupported" and e.value.message.startswith("no CUDA driver")
    with pytest.raises(KvnodeError) as e:
        g.wait_registered(timeout_s=5)
    assert e.value.code == "Unsupported"
    ns = c.register({"model": "t", "page_size": 16, "segments": [4096]})["ns"]
    # Page moves before an attach are refused by the daemon (the op encodes and is understood).
    for call in (g.onload, g.offload, g.onload_async):
        with pytest.raises(KvnodeError) as e:
            call(ns, [[b"\x02" * 32, 0]], [0])
        assert e.value.code == "NotOwned"
    with pytest.raises(KvnodeError) as e:
        g.onload_wait(12345)
    assert e.value.code == "NotOwned"
    with pytest.raises(gpu.LayoutError, match="page ids"):
        g.onload(ns, [[b"\x02" * 32, 0]], [0, 1])
    c.close()
