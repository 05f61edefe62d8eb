#!/usr/bin/env python3
"""Fails when modules import each other in a loop, in any crate of the workspace.

For every module P of a crate (the crate root included), its child modules are nodes, and
child A depends on child B when any file under A names a path under B (`crate::...`,
`super::...`, `self::...`, or a sibling name at the start of a `use`). Any cycle among the
children of one parent is an import loop. A child using items its own parent defines (the
usual `use super::Thing`) is not a loop between modules of one level and is allowed.

Usage: scripts/check-import-cycles.py [CRATE_SRC_DIR ...]  (default: every crate src/ dir)
"""
import os
import re
import sys
from collections import defaultdict

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)::\{([^;]*)\};", re.S)


def modules(src):
    """Maps module path tuples to files."""
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            if parts and parts[0] in ("bin",):
                continue
            mods[tuple(parts)] = os.path.join(dirpath, f)
    return mods


def strip_comments(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def resolve(base, segs, mods):
    """The deepest existing module named by `base` + `segs`."""
    path = list(base)
    best = tuple(path)
    for s in segs:
        path.append(s)
        if tuple(path) in mods:
            best = tuple(path)
        else:
            break
    return best


def refs(mod, text, mods):
    out = set()
    # a file `foo.rs` (not mod.rs) is module foo; its `super` is foo's parent
    def base_of(kind):
        if kind == "crate":
            return ()
        if kind == "self":
            return mod
        return mod[:-1]

    for m in PATH.finditer(text):
        segs = m.group(2).split("::")[1:]
        out.add(resolve(base_of(m.group(1)), segs, mods))
    for m in USE_GROUP.finditer(text):
        base = base_of(m.group(1))
        for item in re.split(r",", m.group(2)):
            segs = [s for s in re.split(r"::|\{", item.strip()) if re.match(r"^[A-Za-z_]\w*$", s.strip())]
            if segs:
                out.add(resolve(base, [s.strip() for s in segs], mods))
    return out


def cycles(src):
    mods = modules(src)
    deps = defaultdict(set)
    for mod, f in mods.items():
        text = strip_comments(open(f, encoding="utf-8").read())
        for r in refs(mod, text, mods):
            if r != mod:
                deps[mod].add(r)
    found = []
    parents = {m[:-1] for m in mods if m} | {()}
    for p in sorted(parents):
        kids = sorted({m[: len(p) + 1] for m in mods if len(m) > len(p) and m[: len(p)] == p})
        edges = defaultdict(set)
        for a in kids:
            for m, ds in deps.items():
                if m[: len(a)] != a:
                    continue
                for d in ds:
                    for b in kids:
                        if b != a and d[: len(b)] == b:
                            edges[a].add(b)
        found += [(p, c) for c in sccs(kids, edges) if len(c) > 1]
    return found


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def crate_dirs(root):
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("target", ".git", "node_modules") and not d.startswith("target")]
        if "Cargo.toml" in files and os.path.isdir(os.path.join(dirpath, "src")):
            out.append(os.path.join(dirpath, "src"))
    return sorted(out)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = sys.argv[1:] or crate_dirs(root)
    bad = 0
    for d in dirs:
        for parent, comp in cycles(d):
            bad += 1
            names = ", ".join("::".join(c) for c in sorted(comp))
            where = "::".join(parent) or "crate root"
            print(f"{os.path.relpath(d, root)}: import loop under {where}: {names}")
    print(f"import-cycles: {len(dirs)} crates checked, {bad} loop(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
