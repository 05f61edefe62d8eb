#!/usr/bin/env bash
# Installs what the deploy stage needs on Debian 12 (docs/deploy.md). Idempotent.
#   - podman + runc (the container test runs with --runtime runc: crun refuses hybrid
#     cgroups), mmdebstrap (the image's root file system, from Debian packages only),
#     dpkg-dev (dpkg-deb for the .deb), uidmap (podman's user namespace helpers);
#   - kubernetes-validate, pinned with hashes (packaging/deploy-tools.lock), in a venv of its
#     own named after the lock file's hash: a changed lock builds a new venv.
# Prints nothing on success unless it installs something. Called by scripts/install-deps.sh
# (test mode). `--print-venv`: installs as above, then prints the venv's path (tests/deploy).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
need=()
for pkg in podman runc mmdebstrap dpkg-dev uidmap; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "install-deploy-deps: installing ${need[*]}" >&2
  $SUDO apt-get update -qq
  # --no-install-recommends: podman recommends crun, which this machine's cgroups refuse.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${need[@]}" >/dev/null
fi
lock=packaging/deploy-tools.lock
hash=$(sha256sum "$lock" | cut -c1-16)
venv="${KVNODE_DEPLOY_VENV:-$HOME/.cache/kvnode-deploy-venv-$hash}"
if ! "$venv/bin/python" -c "import kubernetes_validate, yaml, jsonschema" >/dev/null 2>&1; then
  echo "install-deploy-deps: building $venv from $lock" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --require-hashes --no-deps -r "$lock"
fi
[ "${1:-}" = --print-venv ] && echo "$venv"
exit 0
