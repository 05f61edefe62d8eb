#!/usr/bin/env bash
# The deploy stage (cargo xtask deploy; docs/deploy.md): builds the image, then runs every
# deploy test and prints "N passed, N failed". Each test is a script that exits non-zero with
# a FAIL line on the first broken check; none skips. Needs root and
# scripts/install-deploy-deps.sh (podman, runc, mmdebstrap, dpkg-dev, the validator venv).
# The daemon the tests run on the host is the one the packages ship (packaging/build-release.sh:
# its own release build in target/package, probed for test seams), built first.
# Usage: tests/deploy/run.sh [TEST...]   (default: all; names: manifests wheel dashboard container engines deb)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
[ "$(id -u)" -eq 0 ] || { echo "tests/deploy: needs root (mmdebstrap, rootful podman, dpkg in a container)" >&2; exit 1; }
venv=$(bash scripts/install-deploy-deps.sh --print-venv)
tests=("$@")
((${#tests[@]})) || tests=(manifests wheel dashboard container engines deb)
passed=0 failed=0 names=()
t0=$(date +%s)
needs_image=0
for t in "${tests[@]}"; do case $t in container | engines | deb) needs_image=1 ;; esac; done
if ! bash packaging/build-release.sh >/dev/null; then
  echo "FAIL release build: packaging/build-release.sh" >&2
  echo "0 passed, 1 failed"
  exit 1
fi
if ((needs_image)); then
  t=$(date +%s)
  if bash scripts/build-image.sh; then
    echo "deploy: image built in $(($(date +%s) - t)) s" >&2
  else
    echo "FAIL image: scripts/build-image.sh" >&2
    failed=$((failed + 1)) names+=(image)
  fi
fi
for t in "${tests[@]}"; do
  t1=$(date +%s)
  case $t in
    manifests) cmd=("$venv/bin/python" "$here/manifests.py") ;;
    *) cmd=(bash "$here/$t.sh") ;;
  esac
  echo "=== deploy test $t" >&2
  if "${cmd[@]}"; then
    passed=$((passed + 1))
    echo "=== deploy test $t: ok ($(($(date +%s) - t1)) s)" >&2
  else
    failed=$((failed + 1)) names+=("$t")
    echo "=== deploy test $t: FAILED ($(($(date +%s) - t1)) s)" >&2
  fi
done
echo "deploy: $(($(date +%s) - t0)) s; failed: ${names[*]:-none}" >&2
echo "$passed passed, $failed failed"
((failed == 0))
