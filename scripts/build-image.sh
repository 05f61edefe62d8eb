#!/usr/bin/env bash
# Builds the kvnode OCI image from Debian packages only (docs/deploy.md):
#   1. a Debian 12 root file system (packaging/image/mkrootfs.sh: mmdebstrap, Essential packages
#      plus packaging/image/packages.txt), cached as $KVNODE_IMAGE_CACHE/rootfs-<hash>.tar, the
#      hash covering the package list and mkrootfs.sh;
#   2. `podman build --format docker` of packaging/image/Containerfile (FROM scratch: nothing is
#      pulled) over that tarball, kvnode and kvtrace as packaging/build-release.sh builds them
#      (their own release build in target/package, probed for test seams) and
#      packaging/image/kvnode-pod;
#   3. checks that every library the binaries link resolves inside the image (ldd there).
# Usage: scripts/build-image.sh [TAG]   (default localhost/kvnode:<version>; also tagged :latest)
# Needs root (mmdebstrap's root mode, rootful podman), podman, mmdebstrap
# (scripts/install-deploy-deps.sh) and cargo. Prints the image's tag and size last.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || revision="$revision-dirty"
tag=${1:-localhost/kvnode:$version}
cache=${KVNODE_IMAGE_CACHE:-$HOME/.cache/kvnode-image}
bin=$(bash packaging/build-release.sh)
mkdir -p "$cache"

key=$(cat packaging/image/packages.txt packaging/image/mkrootfs.sh | sha256sum | cut -c1-16)
rootfs="$cache/rootfs-$key.tar"
if [ ! -f "$rootfs" ] || [ ! -s "$rootfs" ]; then
  t=$(date +%s)
  # mmdebstrap picks its output format from the name's ending: the partial file must end
  # in .tar too, or it becomes a directory.
  part="$cache/rootfs-$key.part.tar"
  rm -rf "$rootfs" "$part"
  bash packaging/image/mkrootfs.sh "$part"
  mv "$part" "$rootfs"
  # One root file system in the cache (tests/deploy/deb.sh installs the .deb onto it).
  find "$cache" -maxdepth 1 -name 'rootfs-*.tar*' ! -name "$(basename "$rootfs")" -delete
  echo "build-image: root file system in $(($(date +%s) - t)) s: $rootfs ($(du -h "$rootfs" | cut -f1))" >&2
else
  echo "build-image: cached root file system $rootfs" >&2
fi

ctx=$(mktemp -d /var/tmp/kvnode-image-ctx.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
ln "$rootfs" "$ctx/rootfs.tar" 2>/dev/null || cp "$rootfs" "$ctx/rootfs.tar"
install -m 0755 "$bin/kvnode" "$bin/kvtrace" packaging/image/kvnode-pod "$ctx/"
# Debug info off (the USDT notes, .note.stapsdt, stay: kvtrace needs them).
strip --strip-debug "$ctx/kvnode" "$ctx/kvtrace"
install -m 0644 packaging/image/kvnode.toml "$ctx/"
podman build --quiet --format docker --runtime runc \
  --build-arg VERSION="$version" --build-arg REVISION="$revision" \
  --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  -f packaging/image/Containerfile -t "$tag" -t "${tag%:*}:latest" "$ctx" >/dev/null

# Every shared library the binaries need is in the image.
nofile=$(($(ulimit -Hn) < 65536 ? $(ulimit -Hn) : 65536))
missing=$(podman run --rm --runtime runc --ulimit "nofile=$nofile:$nofile" --ulimit nproc=4096:4096 \
  --network none --no-healthcheck --entrypoint /usr/bin/ldd "$tag" \
  /usr/bin/kvnode /usr/bin/kvtrace | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "build-image: libraries missing in the image (add their packages to packaging/image/packages.txt):" >&2
  echo "$missing" >&2
  exit 1
fi
# The image's daemon carries no test seams (as packaging/build-release.sh checked before
# copying it): a fault-injection setting is refused as an unknown field, even with the switch a
# seam build needs to start at all (KVNODE_TEST_SEAMS=1).
seams=$(printf '[peer]\ndebug_fault = { corrupt_block = 1 }\n' | podman run --rm -i --runtime runc \
  --ulimit "nofile=$nofile:$nofile" --ulimit nproc=4096:4096 --network none --no-healthcheck \
  --env KVNODE_TEST_SEAMS=1 \
  --entrypoint /bin/sh "$tag" -c 'cat >/tmp/s.toml; /usr/bin/kvnode serve --print-config --config /tmp/s.toml' 2>&1 || true)
grep -q debug_fault <<<"$seams" && ! grep -q '^socket = ' <<<"$seams" || {
  echo "build-image: the image's kvnode accepts a fault-injection config (built with test seams?): packaging/build-release.sh builds it alone" >&2
  exit 1
}
# Earlier builds' images, now untagged, would pile up run after run.
podman image prune -f >/dev/null
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "build-image: $tag (version $version, revision $revision): $((size / 1024 / 1024)) MiB ($size bytes)"
cd "$root"
