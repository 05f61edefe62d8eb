"""An SGLang-shaped MHA host pool on a memfd, with MHATokenToKVPoolHost's pointer math (0.5.23)."""

import mmap
import os
from types import SimpleNamespace

import torch


class ShmMhaPool:
    """Buffers and `get_page_buffer_meta` as in sglang/srt/mem_cache/pool_host/mha.py.

    SGLang's own class needs the model-config tree (transformers) to import, so the test
    rebuilds its buffer shapes and pointer arithmetic; the memfd comes from SGLang's alloc_shm.
    """

    def __init__(self, layout, pages=16, page_size=4, layer_num=3, head_num=2, head_dim=64,
                 dtype=torch.bfloat16, shm=True, sealable=False):
        self.layout, self.page_size, self.layer_num = layout, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.size = pages * page_size
        dims = {
            "layer_first": (2, layer_num, self.size, head_num, head_dim),
            "page_first": (2, self.size, layer_num, head_num, head_dim),
            "page_first_direct": (2, pages, layer_num, page_size, head_num, head_dim),
        }[layout]
        n = 2 * self.size * layer_num * head_num * head_dim * dtype.itemsize
        if shm and not sealable:
            # SGLang's own allocation (ShmHostTensorAllocator calls it): an unsealable memfd.
            from sglang.srt.mem_cache.storage.mmap import alloc_shm

            self.kv_buffer, self.fd, mm = alloc_shm(dims, dtype)
            self.allocator = SimpleNamespace(mm=mm, fd=self.fd)
        elif shm:
            # As SGLang's, plus MFD_ALLOW_SEALING (the daemon then seals it).
            flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
            self.fd = os.memfd_create("sglang_host_pool_test", flags)
            os.ftruncate(self.fd, n)
            mm = mmap.mmap(self.fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.allocator = SimpleNamespace(mm=mm, fd=self.fd)
            self.kv_buffer = torch.frombuffer(mm, dtype=dtype).view(dims)
        else:
            self.fd = None
            self.allocator = SimpleNamespace()
            self.kv_buffer = torch.zeros(dims, dtype=dtype)
        self.raw = self.kv_buffer.view(-1).view(torch.uint8)

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        ptrs, base, it = [], self.kv_buffer.data_ptr(), self.dtype.itemsize
        indices = indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * it
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k = (base + indices[index] * self.head_num * self.head_dim * it
                         + layer_id * self.size * self.head_num * self.head_dim * it)
                    ptrs += [k, k + v_offset]
            size = it * self.page_size * self.head_num * self.head_dim
        else:
            for index in range(0, len(indices), self.page_size):
                k = base + indices[index] * self.layer_num * self.head_num * self.head_dim * it
                ptrs += [k, k + v_offset]
            size = self.layer_num * it * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    def indices(self, pages):
        return torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])

    def page_bytes(self, page):
        """Every byte of one page, object by object, as the daemon sees them."""
        ptrs, sizes = self.get_page_buffer_meta(self.indices([page]))
        b0 = self.kv_buffer.data_ptr()
        return b"".join(bytes(self.raw[p - b0:p - b0 + s].numpy()) for p, s in zip(ptrs, sizes))

    def fill_random(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.raw.copy_(torch.randint(0, 256, self.raw.shape, generator=g, dtype=torch.uint8))
