"""`python -m kvnode.sglang patch --check | --apply | --revert [--root DIR] | --print`.

Exit status: 0 done (for --check: the seam is applied), 3 (--check only) not applied but
applies exactly, 2 refused (wrong sglang version, or a tree that matches neither side).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvnode.sglang import seam


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvnode.sglang")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("patch", help="kvnode's KV-hint seam for sglang " + seam.SGLANG_VERSION)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="report whether the seam is applied")
    mode.add_argument("--apply", action="store_true", help="apply the seam (idempotent)")
    mode.add_argument("--revert", action="store_true", help="revert the seam (idempotent)")
    mode.add_argument("--print", action="store_true", help="print the patch file's path")
    p.add_argument("--root", type=Path, default=None,
                   help="directory holding the sglang package (default: the installed one, "
                        "whose version must be " + seam.SGLANG_VERSION + ")")
    a = ap.parse_args(argv)
    if a.print:
        print(seam.PATCH_FILE)
        return 0
    try:
        if a.check:
            state = seam.check(a.root)
            print(f"kvnode sglang seam: {state}")
            return 0 if state == "applied" else 3
        done = seam.apply(a.root) if a.apply else seam.revert(a.root)
    except seam.SeamError as e:
        print(f"kvnode sglang seam: refused: {e}", file=sys.stderr)
        return 2
    print(f"kvnode sglang seam: {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
