"""The SGLang backend's first module path, still valid: deployments name it as the
`module_path` of `--hicache-storage-backend-extra-config`. The backend is
`kvnode.sglang.backend` (docs/sglang.md); this module only re-exports it."""

from kvnode.sglang.backend import (
    HAVE_SGLANG,
    MAX_REGIONS,
    KvnodeStorage,
    UnsupportedPool,
    default_socket,
    router_hint_fields,
)

__all__ = ["KvnodeStorage", "UnsupportedPool", "router_hint_fields", "default_socket", "HAVE_SGLANG",
           "MAX_REGIONS"]
