"""kvnode's engine-side seam for sglang 0.5.23: version-checked, exact, reversible, applied here.

The suite runs against the installed sglang with the seam applied (scripts/install-deps.sh
applies it); these tests pin that, the key both sides use, and the patch tool's behaviour on a
copy of the wheel's own files.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvnode.hints import HINT_KEY
from kvnode.sglang import seam
from kvnode.sglang.patchfile import parse

PY_ROOT = Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvnode.sglang", "patch", *args], cwd=PY_ROOT,
                          capture_output=True, text=True)


def test_installed_sglang_is_0_5_23_with_the_seam_applied():
    import importlib.metadata

    assert importlib.metadata.version("sglang") == seam.SGLANG_VERSION
    assert seam.check() == "applied", "run: python -m kvnode.sglang patch --apply"
    assert seam.seam_installed()
    r = _cli("--check")
    assert (r.returncode, r.stdout.strip()) == (0, "kvnode sglang seam: applied"), r.stderr


def test_one_named_key_on_both_sides():
    """A rename on one side would silently stop every hint from being found."""
    from sglang.srt.mem_cache.hicache_storage import KV_HINTS_EXTRA_INFO_KEY, storage_extra_info

    assert KV_HINTS_EXTRA_INFO_KEY == HINT_KEY == "kv_hints"
    info = storage_extra_info(["p"], {"protocol_version": "0.1"})
    assert info.prefix_keys == ["p"] and info.extra_info == {HINT_KEY: {"protocol_version": "0.1"}}
    assert storage_extra_info(None, None).extra_info is None, "no hint: extra_info stays None"


@pytest.fixture
def wheel_copy(tmp_path):
    """The patched files of the installed wheel, copied, then reverted to the wheel's bytes."""
    root = seam.installed_root()
    for fp in parse(seam.PATCH_FILE.read_text()):
        dst = tmp_path / fp.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / fp.path, dst)
    assert seam.revert(tmp_path) in ("reverted", "not applied")
    return tmp_path


def test_patch_tool_applies_reverts_and_is_idempotent(wheel_copy):
    files = parse(seam.PATCH_FILE.read_text())
    assert len(files) == 8
    before = {fp.path: (wheel_copy / fp.path).read_bytes() for fp in files}
    assert _cli("--check", "--root", str(wheel_copy)).returncode == 3, "clean: not applied"
    r = _cli("--apply", "--root", str(wheel_copy))
    assert r.returncode == 0 and "applied" in r.stdout, r.stderr
    assert seam.check(wheel_copy) == "applied"
    installed = seam.installed_root()
    for fp in files:
        assert (wheel_copy / fp.path).read_bytes() == (installed / fp.path).read_bytes(), fp.path
    assert "already applied" in _cli("--apply", "--root", str(wheel_copy)).stdout
    assert _cli("--revert", "--root", str(wheel_copy)).returncode == 0
    assert {fp.path: (wheel_copy / fp.path).read_bytes() for fp in files} == before
    assert "not applied" in _cli("--revert", "--root", str(wheel_copy)).stdout


def test_patch_tool_refuses_a_tree_that_matches_neither_side(wheel_copy):
    f = wheel_copy / "sglang/srt/managers/scheduler.py"
    f.write_text(f.read_text().replace("storage_hit_end=storage_hit_end,", "storage_hit_end=None,"))
    r = _cli("--apply", "--root", str(wheel_copy))
    assert r.returncode == 2 and "scheduler.py: conflict" in r.stderr, r.stderr
    untouched = wheel_copy / "sglang/srt/mem_cache/hicache_storage.py"
    assert "KV_HINTS_EXTRA_INFO_KEY" not in untouched.read_text(), "a refused apply wrote a file"


def test_patch_tool_refuses_another_sglang_version(monkeypatch):
    monkeypatch.setattr(seam, "_installed_version", lambda: "0.5.24")
    with pytest.raises(seam.SeamError, match="written for sglang 0.5.23, this environment has sglang 0.5.24"):
        seam.check()
