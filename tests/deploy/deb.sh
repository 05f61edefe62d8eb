#!/usr/bin/env bash
# The Debian package (packaging/deb/build-deb.sh) installed the way an operator installs it,
# on a bare Debian 12 (a container of the image's root file system, without kvnode in it: the
# package is installed into a clean system, not onto this shared machine):
#   dpkg -i: the kvnode system user, /etc/kvnode/kvnode.toml (a conffile), the unit, the
#   binaries; the installed unit passes `systemd-analyze verify` (run here, on the host, on the
#   unit extracted from the package); the installed binary started with the installed config as
#   the kvnode user (systemd is not PID 1 in a container, so the test starts what ExecStart
#   names, with RuntimeDirectory's directory made as systemd makes it) serves a put and a get
#   and stops on SIGTERM with exit 0; dpkg --purge removes binary, unit, config, user and state.
source "$(dirname "$0")/lib.sh"
dir=$(scratch deb)
ctr=kvnode-deb-$$
cleanup() { podman rm -f -t 0 "$ctr" >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap cleanup EXIT
step "build the .deb"
deb=$(bash "$ROOT/packaging/deb/build-deb.sh" "$dir")
dpkg-deb --info "$deb" | grep -E "Package|Version|Depends" >&2
dpkg-deb -x "$deb" "$dir/x"
unit=$dir/x/lib/systemd/system/kvnode.service
grep -q '^ExecStart=/usr/bin/kvnode serve --config /etc/kvnode/kvnode.toml$' "$unit" || fail "the unit does not start /usr/bin/kvnode"
grep -q '^User=kvnode$' "$unit" || fail "the unit does not run as kvnode"
step "systemd-analyze verify"
# verify resolves ExecStart against the running system: point it at the extracted binary.
sed -e "s|/usr/bin/kvnode|$dir/x/usr/bin/kvnode|g" "$unit" >"$dir/kvnode.service"
out=$(systemd-analyze verify "$dir/kvnode.service" 2>&1) || fail "systemd-analyze verify: $out"
# Only warnings about this machine's systemd state may remain, none about the unit itself.
if grep -i "kvnode.service" <<<"$out" | grep -v "Documentation" | grep -q .; then fail "systemd-analyze verify: $out"; fi
step "dpkg -i into a bare Debian 12 container"
rootfs=$(ls -t "${KVNODE_IMAGE_CACHE:-$HOME/.cache/kvnode-image}"/rootfs-*.tar | head -1)
[ -s "$rootfs" ] || fail "no cached root file system: run scripts/build-image.sh"
podman import -q "$rootfs" "localhost/kvnode-rootfs:deb-test" >/dev/null
"${PODMAN_RUN[@]}" -d --name "$ctr" --network none --user 0 --cap-add IPC_LOCK -v "$dir:/deb:ro" \
  localhost/kvnode-rootfs:deb-test sleep 600 >/dev/null
in_ctr() { podman exec "$ctr" "$@"; }
# The image's root file system has the image's kvnode user and directories: a bare system not.
in_ctr sh -c 'sed -i "/^kvnode:/d" /etc/passwd /etc/group /etc/shadow && rm -rf /var/lib/kvnode /var/lib/kvnode-pod /run/kvnode'
in_ctr dpkg -i "/deb/$(basename "$deb")" >&2 || fail "dpkg -i failed"
in_ctr getent passwd kvnode | grep -q ':/var/lib/kvnode:' || fail "no kvnode system user"
uid=$(in_ctr id -u kvnode)
[ "$uid" -lt 1000 ] || fail "kvnode is not a system user (uid $uid)"
in_ctr test -x /usr/bin/kvnode -a -x /usr/bin/kvtrace -a -f /lib/systemd/system/kvnode.service || fail "files missing"
in_ctr grep -q '^/etc/kvnode/kvnode.toml$' /var/lib/dpkg/info/kvnode.conffiles || fail "kvnode.toml is not a conffile"
in_ctr /usr/bin/kvnode serve --config /etc/kvnode/kvnode.toml --print-config | grep -q '^socket = "/run/kvnode/kvnode.sock"' ||
  fail "the installed config does not parse"
step "start the installed daemon as kvnode with the installed config"
in_ctr install -d -o kvnode -g kvnode -m 0755 /run/kvnode
in_ctr sh -c 'setpriv --reuid kvnode --regid kvnode --init-groups /usr/bin/kvnode serve --config /etc/kvnode/kvnode.toml --dram 32MiB --slab-size 2MiB >/tmp/kvnode.log 2>&1 & echo $! >/tmp/kvnode.pid'
for ((i = 0; i < 100; i++)); do
  in_ctr /usr/bin/kvnode stats --socket /run/kvnode/kvnode.sock >/dev/null 2>&1 && break
  sleep 0.1
done
[ "$i" -lt 100 ] || { in_ctr cat /tmp/kvnode.log >&2; fail "the installed daemon did not answer"; }
in_ctr stat -c %U /run/kvnode/kvnode.sock | grep -qx kvnode || fail "the socket is not the kvnode user's"
in_ctr sh -c 'ps -o user= -p "$(cat /tmp/kvnode.pid)" 2>/dev/null || stat -c %U /proc/$(cat /tmp/kvnode.pid)' | grep -qx kvnode ||
  fail "the daemon does not run as kvnode"
keys=(--tokens "$(seq -s, 1 128)" --model deb --page-size 64 --page-bytes 64KiB)
in_ctr /usr/bin/kvnode put --socket /run/kvnode/kvnode.sock "${keys[@]}" --seed 3 | grep -q "^stored 2" || fail "put"
in_ctr /usr/bin/kvnode get --socket /run/kvnode/kvnode.sock "${keys[@]}" | grep -q "^2 of 2 leading pages hit" || fail "get"
in_ctr sh -c 'kill -TERM "$(cat /tmp/kvnode.pid)"'
for ((i = 0; i < 100; i++)); do
  in_ctr sh -c 'kill -0 "$(cat /tmp/kvnode.pid)" 2>/dev/null' || break
  sleep 0.1
done
in_ctr grep -q "kvnode stopped" /tmp/kvnode.log || { in_ctr cat /tmp/kvnode.log >&2; fail "no clean stop on SIGTERM"; }
step "dpkg --purge"
in_ctr dpkg --purge kvnode >&2 || fail "dpkg --purge failed"
for p in /usr/bin/kvnode /usr/bin/kvtrace /lib/systemd/system/kvnode.service /etc/kvnode /var/lib/kvnode; do
  if in_ctr test -e "$p"; then fail "$p left after purge"; fi
done
if in_ctr getent passwd kvnode >/dev/null; then fail "the kvnode user is left after purge"; fi
echo "ok: deb $(basename "$deb") ($(du -h "$deb" | cut -f1))"
