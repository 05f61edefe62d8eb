"""GPU smoke test against a running kvnode daemon (run by scripts/gpu-smoke.sh on a CUDA machine).

A torch process exports a layer-first, KV-shaped bf16 tensor with CUDA IPC, the daemon
offloads every page into its DRAM tier, the tensor is zeroed, the daemon onloads every page
back, and every byte is compared. Also: a cancelled async onload, bad page ids, and that the
daemon closes the mapping when this client disconnects. Speaks the wire protocol directly
(docs/client-protocol.md) with msgpack, so it needs no kvnode Python package.
"""
import hashlib
import os
import socket
import struct
import sys
import time

import msgpack
import torch

SOCK = sys.argv[1]
LAYERS, PAGES, TOKENS, HEADS, DIM = 4, 64, 64, 8, 128


class Conn:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(path)
        self.id = 0
        r = self.call({"Hello": {"version": 1, "client": "gpu-smoke"}})
        assert "HelloOk" in r, r

    def recv_exact(self, n):
        b = b""
        while len(b) < n:
            c = self.s.recv(n - len(b))
            if not c:
                raise EOFError("daemon closed")
            b += c
        return b

    def call(self, op):
        self.id += 1
        h = msgpack.packb({"id": self.id, "op": op}, use_bin_type=True)
        self.s.sendall(struct.pack("<II", len(h), 0) + h)
        hl, pl = struct.unpack("<II", self.recv_exact(8))
        r = msgpack.unpackb(self.recv_exact(hl), raw=False)
        self.recv_exact(pl)
        return r["reply"]


def key(i):
    return [hashlib.sha256(b"gpu-smoke-%d" % i).digest(), 0]


def main():
    t0 = time.time()
    c = Conn(SOCK)
    # Wait for the daemon's arena registration so copies run pinned.
    for _ in range(600):
        st = c.call("Stats")["Stats"]
        if st["gpu"]["driver"].startswith("ready") and st["gpu"]["registered_bytes"] >= st["tiers"][0]["capacity_bytes"]:
            break
        time.sleep(0.1)
    print("daemon gpu stats:", st["gpu"])

    torch.manual_seed(0)
    # layer-first KV buffer: [layer][K|V][page][tokens][heads][dim]
    kv = torch.randn(LAYERS, 2, PAGES, TOKENS, HEADS, DIM, device="cuda:0", dtype=torch.bfloat16)
    ref = kv.clone()
    chunk = TOKENS * HEADS * DIM * 2  # bytes of one (layer, K/V) slice of a page
    storage = kv.untyped_storage()
    dev, handle, size, offset = storage._share_cuda_()[:4]
    if len(handle) == 66:
        # torch >= 2.x prefixes cudaIpcMemHandle_t with a version byte and a kind byte
        # ('c' = plain cudaMalloc segment); the daemon takes the raw 64-byte handle.
        print(f"torch handle header: version {handle[0]}, kind {chr(handle[1])!r}")
        assert chr(handle[1]) == "c", "expandable segments cannot be exported as one IPC handle"
        handle = handle[2:]
    print(f"exported storage: device {dev} handle {len(handle)} bytes, storage {size} bytes at offset {offset}")
    layout = {
        "base": offset,
        "page_stride": chunk,
        "pages": PAGES,
        "objects": [{"offset": j * PAGES * chunk, "size": chunk} for j in range(LAYERS * 2)],
    }
    r = c.call({"AttachGpu": {"handle": handle, "device": 0, "len": offset + size, "layout": layout}})
    assert "GpuAttached" in r, r
    page_bytes = r["GpuAttached"]["page_bytes"]
    assert page_bytes == LAYERS * 2 * chunk, r
    ns = c.call({"Register": {"spec": {"model": "gpu-smoke", "page_size": TOKENS, "dtype": "bf16",
                                        "layout": "layer_first", "segments": [page_bytes]}}})["Registered"]["ns"]

    keys = [key(i) for i in range(PAGES)]
    ids = list(range(PAGES))
    t = time.time()
    r = c.call({"Offload": {"ns": ns, "keys": keys, "page_ids": ids}})
    dt = time.time() - t
    assert r == {"Offloaded": {"results": ["Stored"] * PAGES}}, r
    print(f"offload: {PAGES} pages x {page_bytes} B in {dt*1e3:.1f} ms ({PAGES*page_bytes/dt/1e9:.2f} GB/s)")

    kv.zero_()
    torch.cuda.synchronize()
    assert not torch.equal(kv, ref)
    t = time.time()
    r = c.call({"Onload": {"ns": ns, "keys": keys, "page_ids": ids}})
    dt = time.time() - t
    assert r == {"Onloaded": {"results": ["Loaded"] * PAGES}}, r
    torch.cuda.synchronize()
    same = torch.equal(kv.view(torch.uint8), ref.view(torch.uint8))
    print(f"onload: {PAGES} pages in {dt*1e3:.1f} ms ({PAGES*page_bytes/dt/1e9:.2f} GB/s); every byte equal: {same}")
    assert same, "onloaded bytes differ"

    # Pages moved to other page ids: page i's block into page PAGES-1-i.
    kv.zero_()
    torch.cuda.synchronize()
    r = c.call({"Onload": {"ns": ns, "keys": keys, "page_ids": ids[::-1]}})
    assert r == {"Onloaded": {"results": ["Loaded"] * PAGES}}, r
    torch.cuda.synchronize()
    assert torch.equal(kv.flip(2).view(torch.uint8), ref.view(torch.uint8)), "permuted onload differs"
    print("onload into permuted page ids: every byte equal: True")

    # Cancel: start an onload, cancel it; after the cancel returns nothing changes any more.
    kv.zero_()
    torch.cuda.synchronize()
    t = c.call({"OnloadAsync": {"ns": ns, "keys": keys, "page_ids": ids}})["OnloadStarted"]["ticket"]
    res = c.call({"OnloadCancel": {"ticket": t}})["Onloaded"]["results"]
    torch.cuda.synchronize()
    snap = kv.clone()
    time.sleep(0.2)
    torch.cuda.synchronize()
    assert torch.equal(snap.view(torch.uint8), kv.view(torch.uint8)), "a write landed after cancel returned"
    for p, s in enumerate(res):
        got = kv[:, :, p]
        if s == "Loaded":
            assert torch.equal(got.view(torch.uint8), ref[:, :, p].view(torch.uint8)), p
        else:
            assert s == "Cancelled" and not got.any(), (p, s)
    print(f"cancelled onload: {res.count('Loaded')} loaded, {res.count('Cancelled')} cancelled; no write after cancel: True")

    # Validation over the wire.
    r = c.call({"Onload": {"ns": ns, "keys": [key(0)], "page_ids": [PAGES]}})
    assert r["Error"]["code"] == "Invalid" and "out of range" in r["Error"]["message"], r
    r = c.call({"AttachGpu": {"handle": handle, "device": 0, "len": offset + size + (1 << 40), "layout": layout}})
    assert r["Error"]["code"] == "Invalid", r
    print("bad page id / oversize length refused:", r["Error"]["message"])
    r = c.call({"AttachGpu": {"handle": handle, "device": 7, "len": offset + size, "layout": layout}})
    assert r["Error"]["code"] == "Invalid", r
    print("bad device refused:", r["Error"]["message"])

    c.s.close()
    c2 = Conn(SOCK)
    for _ in range(100):
        st = c2.call("Stats")["Stats"]["gpu"]
        if st["attached"] == 0:
            break
        time.sleep(0.05)
    assert st["attached"] == 0, st
    print("after disconnect the daemon holds no mapping:", st)
    del kv
    torch.cuda.synchronize()
    print(f"GPU SMOKE OK in {time.time()-t0:.1f}s")


if __name__ == "__main__":
    main()
