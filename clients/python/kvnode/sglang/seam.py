"""Applies, reverts and checks kvnode's KV-hint seam on an installed SGLang 0.5.23.

SGLang 0.5.23 carries `GenerateReqInput.kv_hints` (a typed `KvHintsEnvelope`) from the
HTTP body and both `Engine.generate` APIs through tokenization into the `Req`, but stops
there: no storage backend ever sees it. The patch beside this file threads `req.kv_hints`
through the scheduler's prefetch, both prefetch controller stacks (`HiCacheController`,
`HybridCacheController`, including the PP ticket path) and the decode-side L3 query into
`HiCacheStorageExtraInfo.extra_info[KV_HINTS_EXTRA_INFO_KEY]` of every prefetch-side
storage call; it adds an opt-in router-token gate on `/generate`
(`SGLANG_KV_HINTS_TOKEN`) and two diagnostics (a flush refused by in-flight HiCache work,
prefetches declined by the rate limiter). It is exact (no fuzz) and version-checked.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Dict, Optional

from kvnode.sglang import patchfile

SGLANG_VERSION = "0.5.23"
PATCH_FILE = Path(__file__).with_name(f"sglang-{SGLANG_VERSION}-kv-hints.patch")


class SeamError(RuntimeError):
    """The seam cannot be applied, reverted or checked here (the message says why)."""


def installed_root() -> Path:
    """The directory holding the installed `sglang` package (site-packages), without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SeamError("sglang is not installed in this Python environment")
    return Path(list(spec.submodule_search_locations)[0]).parent


def _installed_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as e:
        raise SeamError("sglang is not installed in this Python environment") from e


def _target(root: Optional[Path]) -> Path:
    if root is not None:
        return Path(root)
    version = _installed_version()
    if version != SGLANG_VERSION:
        raise SeamError(
            f"the kvnode seam is written for sglang {SGLANG_VERSION}, this environment has "
            f"sglang {version}; refusing to touch it")
    return installed_root()


def check(root: Optional[Path] = None) -> str:
    """'applied', 'clean' (not applied, applies exactly) or raises SeamError on a mixed tree."""
    files = patchfile.parse(PATCH_FILE.read_text())
    st = patchfile.states(_target(root), files)
    kinds = set(st.values())
    if kinds == {"applied"}:
        return "applied"
    if kinds == {"clean"}:
        return "clean"
    raise SeamError("the sglang tree matches neither the patched nor the unpatched files: "
                    + ", ".join(f"{p}: {s}" for p, s in sorted(st.items()) if s not in ("applied",)))


def apply(root: Optional[Path] = None) -> str:
    """Applies the seam; a no-op when already applied. Returns what was done."""
    if check(root) == "applied":
        return "already applied"
    patchfile.write_all(_target(root), patchfile.parse(PATCH_FILE.read_text()), reverse=False)
    return "applied"


def revert(root: Optional[Path] = None) -> str:
    """Reverts the seam; a no-op when not applied. Returns what was done."""
    if check(root) == "clean":
        return "not applied"
    patchfile.write_all(_target(root), patchfile.parse(PATCH_FILE.read_text()), reverse=True)
    return "reverted"


def file_states(root: Optional[Path] = None) -> Dict[str, str]:
    return patchfile.states(_target(root), patchfile.parse(PATCH_FILE.read_text()))


def seam_installed() -> bool:
    """Whether the imported SGLang threads kv_hints to storage backends (the patch is live)."""
    try:
        from sglang.srt.mem_cache import hicache_storage
    except ImportError:
        return False
    return hasattr(hicache_storage, "KV_HINTS_EXTRA_INFO_KEY")
