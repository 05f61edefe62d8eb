"""A unified diff, parsed, and applied or reverted exactly (no fuzz) to a directory tree."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """The patch cannot be parsed, or does not fit the files it names."""


@dataclass
class Hunk:
    old_start: int  # 1-based, as in the diff
    old: List[str] = field(default_factory=list)
    new: List[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str  # relative to the tree root (the diff's a/ b/ prefix removed)
    hunks: List[Hunk] = field(default_factory=list)


def parse(text: str) -> List[FilePatch]:
    """Parses a `git diff` style unified diff of modified files (no creations or deletions)."""
    files: List[FilePatch] = []
    cur: FilePatch | None = None
    hunk: Hunk | None = None
    for n, line in enumerate(text.splitlines(keepends=True), 1):
        if line.startswith("diff --git ") or line.startswith("index "):
            hunk = None
            continue
        if line.startswith("--- "):
            hunk = None
            if line.strip() == "--- /dev/null":
                raise PatchError(f"line {n}: file creation is not supported")
            continue
        if line.startswith("+++ "):
            name = line[4:].strip()
            if name == "/dev/null" or not name.startswith("b/"):
                raise PatchError(f"line {n}: expected '+++ b/PATH', got {line.strip()!r}")
            cur = FilePatch(name[2:])
            files.append(cur)
            continue
        m = _HUNK.match(line)
        if m:
            if cur is None:
                raise PatchError(f"line {n}: hunk before any file header")
            hunk = Hunk(int(m.group(1)))
            cur.hunks.append(hunk)
            continue
        if hunk is None:
            raise PatchError(f"line {n}: unexpected text {line[:60]!r}")
        tag, body = line[:1], line[1:]
        if line in ("\n", "\r\n"):  # an empty context line whose space was stripped
            tag, body = " ", line
        if tag == " ":
            hunk.old.append(body)
            hunk.new.append(body)
        elif tag == "-":
            hunk.old.append(body)
        elif tag == "+":
            hunk.new.append(body)
        elif line.startswith("\\"):
            raise PatchError(f"line {n}: 'No newline at end of file' is not supported")
        else:
            raise PatchError(f"line {n}: bad hunk line {line[:60]!r}")
    if not files:
        raise PatchError("the patch names no file")
    return files


def _find(lines: List[str], block: List[str], near: int) -> List[int]:
    """Every index where `block` occurs in `lines`, nearest to `near` first."""
    k = len(block)
    hits = [i for i in range(len(lines) - k + 1) if lines[i:i + k] == block]
    return sorted(hits, key=lambda i: abs(i - near))


def _locate(lines: List[str], hunks: List[Hunk], reverse: bool) -> List[Tuple[int, Hunk]]:
    """Where each hunk's "before" block sits; raises if one is missing."""
    out = []
    delta = 0
    for h in hunks:
        before, after = (h.new, h.old) if reverse else (h.old, h.new)
        at = _find(lines, before, h.old_start - 1 + delta)
        if not at:
            raise PatchError(f"hunk at line {h.old_start} does not match")
        out.append((at[0], h))
        delta += len(after) - len(before)
    return out


def file_state(text: str, fp: FilePatch) -> str:
    """'clean' (every hunk applies), 'applied' (every hunk reverts) or 'conflict'."""
    lines = text.splitlines(keepends=True)
    for reverse, state in ((False, "clean"), (True, "applied")):
        try:
            _locate(lines, fp.hunks, reverse)
            return state
        except PatchError:
            continue
    return "conflict"


def transform(text: str, fp: FilePatch, reverse: bool) -> str:
    """The file's text with every hunk applied (or reverted); exact context only."""
    lines = text.splitlines(keepends=True)
    spots = _locate(lines, fp.hunks, reverse)
    # Replace from the bottom up so earlier indices stay valid.
    for at, h in sorted(spots, key=lambda s: s[0], reverse=True):
        before, after = (h.new, h.old) if reverse else (h.old, h.new)
        lines[at:at + len(before)] = after
    return "".join(lines)


def states(root: Path, files: List[FilePatch]) -> Dict[str, str]:
    out = {}
    for fp in files:
        p = root / fp.path
        out[fp.path] = file_state(p.read_text(), fp) if p.is_file() else "missing"
    return out


def write_all(root: Path, files: List[FilePatch], reverse: bool) -> None:
    """Transforms every file in memory first, then replaces each one atomically."""
    new = {fp.path: transform((root / fp.path).read_text(), fp, reverse) for fp in files}
    for rel, text in new.items():
        dst = root / rel
        mode = dst.stat().st_mode & 0o7777
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, mode)
            os.replace(tmp, dst)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
