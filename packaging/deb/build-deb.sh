#!/usr/bin/env bash
# Builds the kvnode Debian package with dpkg-deb (no cargo-deb) from binaries it builds itself
# (packaging/build-release.sh: `cargo build --release -p kvnode -p kvtrace` in target/package,
# never the workspace's test build, then the test-seam probe on the daemon):
#   /usr/bin/kvnode, /usr/bin/kvtrace, /lib/systemd/system/kvnode.service (packaging/kvnode.service
#   run as the kvnode user from /usr/bin), /etc/kvnode/kvnode.toml (conffile), the docs;
#   maintainer scripts make the `kvnode` system user and enable the unit (not start it).
# Depends: from dpkg-shlibdeps over the binaries (libucx0, libelf1, ...), plus adduser.
# Usage: packaging/deb/build-deb.sh OUTDIR   -> OUTDIR/kvnode_<version>_<arch>.deb (path printed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:?usage: build-deb.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
bin=$(bash packaging/build-release.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pkg=$work/kvnode
install -d "$pkg/DEBIAN" "$pkg/usr/bin" "$pkg/lib/systemd/system" "$pkg/etc/kvnode" "$pkg/usr/share/doc/kvnode"
install -m 0755 "$bin/kvnode" "$bin/kvtrace" "$pkg/usr/bin/"
strip --strip-debug "$pkg/usr/bin/kvnode" "$pkg/usr/bin/kvtrace"
# The unit as shipped in packaging/, with the package's paths and its own user. The kvnode
# user mlocks the arena through LimitMEMLOCK=infinity (no capability needed).
sed -e 's|/usr/local/bin/kvnode|/usr/bin/kvnode|g' \
    -e 's|^# kvnode: node-level KV-cache daemon. Install the binary as /usr/bin/kvnode and the|# kvnode: node-level KV-cache daemon (Debian package kvnode). Binary /usr/bin/kvnode,|' \
    -e 's|^\[Service\]$|[Service]\nUser=kvnode\nGroup=kvnode\n# /var/lib/kvnode (spill directories may live there), owned by kvnode.\nStateDirectory=kvnode\nStateDirectoryMode=0750|' \
    packaging/kvnode.service >"$pkg/lib/systemd/system/kvnode.service"
grep -q '^User=kvnode$' "$pkg/lib/systemd/system/kvnode.service"
install -m 0644 packaging/deb/kvnode.toml "$pkg/etc/kvnode/kvnode.toml"
install -m 0644 docs/operations.md docs/deploy.md "$pkg/usr/share/doc/kvnode/"
printf 'kvnode %s\nLicense: Apache-2.0 (see the source repository)\n' "$version" >"$pkg/usr/share/doc/kvnode/copyright"
install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$pkg/DEBIAN/"
echo /etc/kvnode/kvnode.toml >"$pkg/DEBIAN/conffiles"
# Shared-library dependencies of the binaries (dpkg-shlibdeps wants a debian/control).
mkdir -p "$work/src/debian"
printf 'Source: kvnode\n\nPackage: kvnode\nArchitecture: any\n' >"$work/src/debian/control"
shlibs=$(cd "$work/src" && dpkg-shlibdeps -O "$pkg/usr/bin/kvnode" "$pkg/usr/bin/kvtrace" 2>/dev/null |
  sed -n 's/^shlibs:Depends=//p')
[ -n "$shlibs" ] || { echo "build-deb: dpkg-shlibdeps found no dependencies" >&2; exit 1; }
size=$(du -sk --exclude=DEBIAN "$pkg" | cut -f1)
cat >"$pkg/DEBIAN/control" <<CTL
Package: kvnode
Version: $version
Architecture: $arch
Maintainer: kvnode developers <kvnode@localhost>
Installed-Size: $size
Depends: adduser, $shlibs
Section: net
Priority: optional
Homepage: https://github.com/kvnode/kvnode
Description: node-level KV-cache daemon for LLM inference
 One daemon per inference node: engine ranks (SGLang HiCache, vLLM, the Rust client)
 deposit and fetch KV-cache pages in one shared, pinned DRAM arena, with an NVMe spill
 tier, peer pulls between nodes and restarts that keep the cache. Includes kvtrace (eBPF).
CTL
deb="$out/kvnode_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz -z1 --build "$pkg" "$deb" >/dev/null
echo "$deb"
