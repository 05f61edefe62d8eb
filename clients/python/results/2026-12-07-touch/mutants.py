"""Runs the Touch tests against copies of clients/python with one touch call (or guard) removed,
to show each test can fail. Usage (from the repo root):

    KVNODE_BIN=... KVNODE_TEST_SEAMS=1 python3 clients/python/results/2026-12-07-touch/mutants.py OUTDIR

Each mutant: a copy of clients/python under /tmp, one exact text replacement (asserted to match
once), then pytest of the named test file in the venv that suite uses; the output goes to
OUTDIR/<mutant>.txt. The unmutated tree passes the same files (OUTDIR/baseline-*.txt).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
SGL = Path.home() / ".cache/kvnode-venvs/sglang-34d64c91bef383d8/bin/python"
VLLM = Path.home() / ".cache/kvnode-venvs/vllm-425648f9980a8091/bin/python"

# name -> (file under clients/python, old text, new text, python, test file)
MUTANTS = {
    "vllm-connector-no-touch": (
        "kvnode/vllm/scheduler_side.py",
        "        self.lookup.submit_touch(self._digests(hashes, blocks))\n",
        "        pass  # MUTANT: touch call removed\n", VLLM, "tests_vllm/test_touch.py"),
    "vllm-connector-no-off-switch": (
        "kvnode/vllm/scheduler_side.py",
        "        if not self.touch_enabled or blocks <= 0:\n",
        "        if blocks <= 0:  # MUTANT: touch_gpu_hits ignored\n", VLLM, "tests_vllm/test_touch.py"),
    "vllm-tier-no-touch": (
        "kvnode/vllm_tier/tier.py",
        "        self._sender.submit_touch(wk, self.touches)\n",
        "        pass  # MUTANT: touch call removed\n", VLLM, "tests_vllm/test_touch.py"),
    "sglang-no-touch": (
        "kvnode/sglang/backend.py",
        "            self.touches.send(conn, b.ns, leading_keys([digest_of(k) for k in prefix[:pages]], b.seg_n))\n",
        "            pass  # MUTANT: touch call removed\n", SGL, "tests/test_touch.py"),
    "sglang-touch-every-batch": (
        "kvnode/sglang/backend.py",
        "        if not self.touch_local_hits or not prefix or continues:\n",
        "        if not self.touch_local_hits or not prefix:  # MUTANT: every batch touches\n", SGL,
        "tests/test_touch.py"),
    "sglang-no-off-switch": (
        "kvnode/sglang/backend.py",
        "        if not self.touch_local_hits or not prefix or continues:\n",
        "        if not prefix or continues:  # MUTANT: touch_local_hits ignored\n", SGL, "tests/test_touch.py"),
    "wire-no-touch": (
        "kvnode/wire.py",
        '        name, body, _ = self.call({"Touch": {"ns": int(ns), "keys": keys}})\n',
        '        name, body = "Touched", {"count": 0}  # MUTANT: touch call removed\n', SGL,
        "tests/test_touch.py"),
    "wire-no-frame-limit": (
        "kvnode/wire.py",
        "        if len(header) > MAX_HEADER:\n",
        "        if False:  # MUTANT: no client-side frame limit\n", SGL, "tests/test_touch.py"),
    "decoder-lenient": (
        "kvnode/wire.py",
        "    if type(count) is not int or not 0 <= count <= _U32_MAX:\n",
        "    if not isinstance(count, (int, float)) or count < 0:  # MUTANT: bools, floats, > u32\n", SGL,
        "tests/test_touch.py"),
    "touchlog-no-cap": (
        "kvnode/touch.py",
        "        keys = list(keys[:MAX_TOUCH_KEYS])\n",
        "        keys = list(keys)  # MUTANT: no bound\n", SGL, "tests/test_touch.py"),
}


def run(tree: Path, py: Path, test: str, out: Path) -> int:
    env = {**os.environ, "PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    p = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:cacheprovider",
                        str(tree / test)], cwd=tree, env=env, capture_output=True, text=True)
    out.write_text(f"$ pytest {test}  (rc={p.returncode})\n{p.stdout}{p.stderr}")
    return p.returncode


def main() -> None:
    outdir = Path(sys.argv[1]).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    only = sys.argv[2:] or list(MUTANTS) + ["baseline"]
    for name in only:
        base = Path("/tmp/touch40-mutants") / name
        shutil.rmtree(base, ignore_errors=True)
        tree = base / "clients" / "python"
        shutil.copytree(ROOT / "clients" / "python", tree,
                        ignore=shutil.ignore_patterns("__pycache__", "results", "bench"))
        if name == "baseline":
            for py, test in ((VLLM, "tests_vllm/test_touch.py"), (SGL, "tests/test_touch.py")):
                rc = run(tree, py, test, outdir / f"baseline-{test.split('/')[0]}.txt")
                print(f"baseline {test}: rc={rc}")
            continue
        rel, old, new, py, test = MUTANTS[name]
        f = tree / rel
        text = f.read_text()
        assert text.count(old) == 1, (name, rel, text.count(old))
        f.write_text(text.replace(old, new))
        rc = run(tree, py, test, outdir / f"{name}.txt")
        print(f"{name}: rc={rc} ({'FAILS as it must' if rc == 1 else 'UNEXPECTED'})")
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
