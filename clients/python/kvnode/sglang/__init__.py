"""kvnode's engine-side seam for SGLang 0.5.23: the per-request KV-hint path, as a patch.

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
