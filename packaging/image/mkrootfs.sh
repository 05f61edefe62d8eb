#!/usr/bin/env bash
# Makes the kvnode image's Debian 12 root file system as a tarball: mmdebstrap's Essential
# variant (no apt, no init) plus packaging/image/packages.txt, the kvnode user (uid/gid 10001)
# and its directories, without docs, man pages or locales (copyright files kept).
# Repositories: those this machine's apt uses for bookworm main (apt-get indextargets), or
# KVNODE_DEBIAN_MIRROR="deb URL SUITE main|deb ..." to name them.
# Usage: packaging/image/mkrootfs.sh OUT.tar   (as root: mmdebstrap's root mode)
set -euo pipefail
out=${1:?usage: mkrootfs.sh OUT.tar}
here=$(dirname "$0")
if [ -n "${KVNODE_DEBIAN_MIRROR:-}" ]; then
  mapfile -t mirrors < <(tr '|' '\n' <<<"$KVNODE_DEBIAN_MIRROR")
else
  mapfile -t mirrors < <(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(COMPONENT)' 'Identifier: Packages' |
    awk '$2 ~ /^bookworm(-updates|-security)?$/ && $3 == "main" { print "deb " $1 " " $2 " main" }' | sort -u)
fi
((${#mirrors[@]})) || { echo "mkrootfs: no Debian bookworm main repository in this machine's apt sources (set KVNODE_DEBIAN_MIRROR)" >&2; exit 1; }
packages=$(grep -v '^#' "$here/packages.txt" | grep -v '^$' | paste -sd, -)
echo "mkrootfs: mmdebstrap bookworm essential + $packages from: ${mirrors[*]}" >&2
# merged-usr hook: /usr merged by symlinks and usr-is-merged installed, as debootstrap does;
# without it apt satisfies init-system-helpers' "usrmerge | usr-is-merged" with usrmerge,
# which pulls in all of perl (30 MB).
mmdebstrap --quiet --mode=root --variant=essential --include="$packages" \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --aptopt='Acquire::Languages "none"' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --customize-hook='echo "kvnode:x:10001:10001:kvnode daemon:/var/lib/kvnode:/usr/sbin/nologin" >>"$1/etc/passwd"' \
  --customize-hook='echo "kvnode:x:10001:" >>"$1/etc/group"' \
  --customize-hook='echo "kvnode:!:19000::::::" >>"$1/etc/shadow"' \
  --customize-hook='install -d -o 10001 -g 10001 -m 0750 "$1/run/kvnode" "$1/var/lib/kvnode" "$1/var/lib/kvnode/spill" "$1/var/lib/kvnode-pod"' \
  --customize-hook='rm -rf "$1"/var/cache/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
  bookworm "$out" "${mirrors[@]}"
