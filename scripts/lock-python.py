#!/usr/bin/env python3
"""Generates the Python test environments' lock files from the wheels' own declared requirements.

    python3 scripts/lock-python.py sglang     # -> scripts/locks/sglang.lock
    python3 scripts/lock-python.py vllm       # -> scripts/locks/vllm.lock
    python3 scripts/lock-python.py --all
    python3 scripts/lock-python.py vllm --report R.json   # walk a saved pip report again
                                                          # (iterating on `exclude` lines)

Input: scripts/locks/ENV.in, lines of
    require SPEC                  a root requirement (pip syntax, normally pinned `name==version`)
    exclude NAME  # REASON        drop NAME (and whatever only it needs); the reason is mandatory
Method:
 1. pip resolves the roots against PyPI with every declared dependency
    (`pip install --dry-run --ignore-installed --report`), in a scratch venv of the same Python
    that runs the tests; nothing is installed, only metadata (or wheels without PEP 658
    metadata) is downloaded.
 2. From the report, the lock is the set reachable from the roots through each wheel's
    `Requires-Dist` (markers evaluated for this interpreter and each requested extra), not
    walking into excluded names. An exclusion that the walk never meets is an error (stale).
 3. Every kept package is written as `name==version --hash=sha256:...` (the hash PyPI
    publishes for the exact wheel resolved), with who requires it.
The lock is installed with `pip install --require-hashes --no-deps -r LOCK` by
scripts/py-venv.sh; a package that a kept wheel declares can therefore only be missing if an
`exclude` line says why.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCKS = HERE / "locks"
# The resolver itself is pinned, so that a regeneration differs only where PyPI metadata did.
PIP = "pip==26.3"


def canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def parse_in(path: Path) -> tuple[list[str], dict[str, str]]:
    roots: list[str] = []
    excludes: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        verb, _, rest = line.partition(" ")
        if verb == "require":
            roots.append(rest.strip())
        elif verb == "exclude":
            name, sep, reason = rest.partition("#")
            if not sep or not reason.strip():
                sys.exit(f"{path}:{n}: exclude {name.strip()} needs a `# reason`")
            excludes[canon(name.strip())] = reason.strip()
        else:
            sys.exit(f"{path}:{n}: unknown verb {verb!r} (require|exclude)")
    return roots, excludes


def resolve(roots: list[str], scratch: Path) -> dict:
    venv = scratch / "resolver"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    env = dict(os.environ)
    env.pop("PIP_FIND_LINKS", None)  # only PyPI: a local wheel directory has no published hash
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    subprocess.run(pip + ["install", "-q", PIP], check=True, env=env)
    report = scratch / "report.json"
    subprocess.run(
        pip + ["install", "--dry-run", "--ignore-installed", "--only-binary", ":all:",
               "--report", str(report), "-q"] + roots,
        check=True, env=env)
    return json.loads(report.read_text())


def walk(report: dict, excludes: dict[str, str]):
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import Requirement

    items = {canon(i["metadata"]["name"]): i for i in report["install"]}
    env = default_environment()
    kept: dict[str, set[str]] = {}       # name -> extras requested of it
    via: dict[str, set[str]] = {}
    met_excluded: dict[str, set[str]] = {}
    todo = []
    for name, item in items.items():
        if item.get("requested"):
            todo.append((name, frozenset(item.get("requested_extras") or ()), "(root)"))
    while todo:
        name, extras, parent = todo.pop()
        if name in excludes:
            met_excluded.setdefault(name, set()).add(parent)
            continue
        via.setdefault(name, set()).add(parent)
        have = kept.get(name)
        if have is not None and extras <= have:
            continue
        kept[name] = (have or set()) | set(extras)
        meta = items[name]["metadata"]
        for spec in meta.get("requires_dist") or ():
            req = Requirement(spec)
            if req.marker is not None and not any(
                    req.marker.evaluate({**env, "extra": e}) for e in ("", *kept[name])):
                continue
            child = canon(req.name)
            if child not in items and child not in excludes:
                sys.exit(f"{name} requires {spec!r} but the resolver did not install {child}")
            todo.append((child, frozenset(req.extras), meta["name"]))
    stale = sorted(set(excludes) - set(met_excluded))
    if stale:
        sys.exit(f"exclusions never required by a kept package (remove them): {stale}")
    return items, kept, via, met_excluded


def write_lock(env_name: str, roots, excludes, items, kept, via, met_excluded) -> Path:
    out = LOCKS / f"{env_name}.lock"
    impl = f"{platform.python_implementation()} {platform.python_version()}"
    lines = [
        f"# Lock for the `{env_name}` test venv. GENERATED by `python3 scripts/lock-python.py {env_name}`",
        f"# from scripts/locks/{env_name}.in; do not edit. Resolved for {impl}, "
        f"{platform.system()} {platform.machine()}.",
        "# Installed by scripts/py-venv.sh with `pip install --require-hashes --no-deps -r` this file.",
        "# Roots: " + ", ".join(roots),
        "#",
        "# Declared but excluded (with what declared them):",
    ]
    for name in sorted(met_excluded):
        lines.append(f"#   {name}: {excludes[name]} (required by {', '.join(sorted(met_excluded[name]))})")
    lines.append("")
    for name in sorted(kept):
        item = items[name]
        info = item["download_info"]
        sha = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
        if not sha:
            sys.exit(f"{name}: the index published no sha256 for {info.get('url')}")
        version = item["metadata"]["version"]
        lines.append(f"{name}=={version} \\")
        lines.append(f"    --hash=sha256:{sha}")
        lines.append(f"    # via {', '.join(sorted(via[name]))}")
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    args = sys.argv[1:]
    saved = None
    if "--report" in args:
        i = args.index("--report")
        saved = json.loads(Path(args[i + 1]).read_text())
        del args[i:i + 2]
    names = sorted(p.stem for p in LOCKS.glob("*.in")) if args == ["--all"] else args
    if not names:
        sys.exit(__doc__)
    for env_name in names:
        roots, excludes = parse_in(LOCKS / f"{env_name}.in")
        if saved is not None:
            report = saved
        else:
            with tempfile.TemporaryDirectory(prefix=f"kvnode-lock-{env_name}-") as tmp:
                report = resolve(roots, Path(tmp))
                (LOCKS / f".{env_name}.report.json").write_text(json.dumps(report))
        out = write_lock(env_name, roots, excludes, *walk(report, excludes))
        print(f"lock-python: wrote {out.relative_to(HERE.parent)}", file=sys.stderr)


if __name__ == "__main__":
    main()
