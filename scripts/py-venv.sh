#!/usr/bin/env bash
# Builds (once per lock) and verifies a Python test venv from its lock file; prints the venv's
# python on its last line.
#
#   scripts/py-venv.sh sglang     # scripts/locks/sglang.lock: clients/python/tests, bench/ttft/tests
#   scripts/py-venv.sh vllm       # scripts/locks/vllm.lock:   clients/python/tests_vllm
#   scripts/py-venv.sh dynamo     # scripts/locks/dynamo.lock: clients/python/tests_dynamo
#
# The venv is keyed by the lock's content: it lives at $KVNODE_VENV_ROOT/ENV-<sha256 of the
# lock, 16 hex> (default root ~/.cache/kvnode-venvs), and holds the full hash in .kvnode-lock.
# A changed lock therefore builds a new venv; a venv whose stamp is missing or differs (a build
# that died half-way, a hand edit) is deleted and rebuilt, never reused. KVNODE_PY_VENV (sglang)
# or KVNODE_VLLM_VENV (vllm) names the venv's directory outright; the same stamp rule holds.
#
# Install: `pip install --require-hashes --no-deps --only-binary :all: -r LOCK`, so exactly the
# locked wheels, byte for byte, and nothing a resolver picked today. Every run (also a reuse)
# then checks that `pip freeze --all` equals the lock (pip itself, the installer, aside) and
# fails listing the difference. The checkout's connector (clients/python) is put on the path
# with a .pth file, not installed, so it is not in the freeze.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_NAME=${1:?usage: $0 sglang|vllm|dynamo}
LOCK=scripts/locks/$ENV_NAME.lock
[ -f "$LOCK" ] || { echo "py-venv: no lock $LOCK" >&2; exit 2; }
PY="${PYTHON:-python3}"
HASH=$(sha256sum "$LOCK" | cut -d' ' -f1)
# The lock's markers were evaluated for one Python minor version: another would need other wheels.
locked_py=$(sed -n 's/.*Resolved for CPython \([0-9]*\.[0-9]*\).*/\1/p' "$LOCK" | head -n 1)
have_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$locked_py" != "$have_py" ]; then
  echo "py-venv: $LOCK was resolved for CPython $locked_py, but $PY is $have_py (set PYTHON, or regenerate the lock)" >&2
  exit 2
fi
case "$ENV_NAME" in
  sglang) OVERRIDE=${KVNODE_PY_VENV:-} ;;
  vllm) OVERRIDE=${KVNODE_VLLM_VENV:-} ;;
  *) OVERRIDE= ;;
esac
VENV=${OVERRIDE:-${KVNODE_VENV_ROOT:-$HOME/.cache/kvnode-venvs}/$ENV_NAME-${HASH:0:16}}

# Lock entries as `name==version`, names normalised as pip freeze prints them (PEP 503, lower).
norm() { awk -F'==' '{ n = tolower($1); gsub(/[_.]+/, "-", n); sub(/ +$/, "", $2); print n "==" $2 }'; }
want() { grep -E '^[A-Za-z0-9]' "$LOCK" | sed 's/ *\\$//' | norm | sort; }
have() {
  "$VENV/bin/python" -m pip freeze --all --disable-pip-version-check 2>/dev/null \
    | grep -v -E '^pip==' | norm | sort
}

# One build at a time per venv (two checkouts, or CI and a developer, may ask at once).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.build-lock"
flock 9
if [[ -f "$VENV/.kvnode-lock" && "$(cat "$VENV/.kvnode-lock")" == "$HASH" ]]; then
  :
else
  if [ -e "$VENV" ]; then
    echo "py-venv: $VENV was not built from this lock ($LOCK): rebuilding it" >&2
    rm -rf "$VENV"
  fi
  start=$(date +%s)
  echo "py-venv: building $VENV from $LOCK" >&2
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  # venv seeds pip and (Python < 3.12) setuptools: only what the lock names may stay.
  "$VENV/bin/python" -m pip uninstall -q -y setuptools >/dev/null 2>&1 || true
  # A find-links directory (PIP_FIND_LINKS, e.g. a wheelhouse made with `pip download`) is
  # fine: pip only takes a file whose sha256 is the lock's, wherever it comes from.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    --require-hashes --no-deps --only-binary :all: -r "$LOCK"
  echo "$HASH" > "$VENV/.kvnode-lock"
  echo "py-venv: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
fi

# The freeze sees only the venv: the checkout path a previous run left in kvnode-checkout.pth
# goes first (its clients/python may hold a kvnode.egg-info from a wheel build, which pip would
# list as an installed kvnode), and is written again below for this checkout.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/kvnode-checkout.pth"
if ! diff <(want) <(have) > "$VENV/.kvnode-freeze.diff"; then
  echo "py-venv: $VENV does not hold exactly $LOCK ('<' locked, '>' installed):" >&2
  cat "$VENV/.kvnode-freeze.diff" >&2
  exit 1
fi

# The checkout's connector on the path (the last checkout to run this wins; the venv may be
# shared between checkouts of the same lock).
echo "$PWD/clients/python" > "$site/kvnode-checkout.pth"
echo "$VENV/bin/python"
