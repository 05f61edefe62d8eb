"""kvnode for SGLang 0.5.23: the HiCache storage backend (`kvnode.sglang.backend`, imported on
its own: it imports SGLang) and the engine-side seam for the per-request KV-hint path, a patch.

`python -m kvnode.sglang patch --check | --apply | --revert` (see `kvnode.sglang.seam`).
"""

from kvnode.sglang.seam import (
    PATCH_FILE,
    SGLANG_VERSION,
    SeamError,
    apply,
    check,
    revert,
    seam_installed,
)

__all__ = ["PATCH_FILE", "SGLANG_VERSION", "SeamError", "apply", "check", "revert", "seam_installed"]
