#!/usr/bin/env bash
# The Debian package (packaging/deb/build-deb.sh) installed the way an operator installs it,
# on a bare Debian 12 (a container of the image's root file system, without kvnode in it: the
# package is installed into a clean system, not onto this shared machine):
#   dpkg -i: the kvnode system user, /etc/kvnode/kvnode.toml (a conffile), the unit, the
#   binaries; the installed unit passes `systemd-analyze verify` (run here, on the host, on the
#   unit extracted from the package), is sandboxed and scores an exposure level of at most 3.0
#   in `systemd-analyze security --offline`; the installed binary started with the installed config as
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
step "systemd-analyze security (the unit's sandboxing)"
for k in NoNewPrivileges=yes ProtectSystem=strict PrivateTmp=yes ProtectHome=yes CapabilityBoundingSet= \
  'RuntimeDirectory=kvnode kvnode-admin' LimitMEMLOCK=infinity Type=notify; do
  grep -qx "$k" "$unit" || fail "the unit lacks $k"
done
sec=$(systemd-analyze security --offline=yes "$dir/kvnode.service" 2>&1 | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
[ -n "$sec" ] || fail "systemd-analyze security --offline gave no exposure level"
python3 -c "import sys; sys.exit(0 if float('$sec') <= 3.0 else 1)" || fail "the unit's exposure level is $sec (want <= 3.0)"
echo "systemd-analyze security: exposure $sec" >&2
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
in_ctr sh -eu -c '
getent passwd kvnode | grep -q ":/var/lib/kvnode:" || { echo "FAIL: no kvnode system user"; exit 1; }
[ "$(id -u kvnode)" -lt 1000 ] || { echo "FAIL: kvnode is not a system user"; exit 1; }
[ "$(stat -c %U:%a /var/lib/kvnode)" = kvnode:750 ] || { echo "FAIL: /var/lib/kvnode"; exit 1; }
test -x /usr/bin/kvnode -a -x /usr/bin/kvtrace -a -f /lib/systemd/system/kvnode.service || { echo "FAIL: files missing"; exit 1; }
grep -qx /etc/kvnode/kvnode.toml /var/lib/dpkg/info/kvnode.conffiles || { echo "FAIL: kvnode.toml is not a conffile"; exit 1; }
' >&2 || fail "the installed package (see above)"
in_ctr /usr/bin/kvnode serve --config /etc/kvnode/kvnode.toml --print-config | grep -q '^socket = "/run/kvnode/kvnode.sock"' ||
  fail "the installed config does not parse"
step "start the installed daemon as kvnode with the installed config"
# One script in the container (each podman exec costs a second on this machine).
in_ctr sh -eu -c '
install -d -o kvnode -g kvnode -m 0755 /run/kvnode /run/kvnode-admin   # what RuntimeDirectory= makes
setpriv --reuid kvnode --regid kvnode --init-groups \
  /usr/bin/kvnode serve --config /etc/kvnode/kvnode.toml --dram 32MiB --slab-size 2MiB >/tmp/kvnode.log 2>&1 &
pid=$!
i=0
until /usr/bin/kvnode stats --socket /run/kvnode/kvnode.sock >/dev/null 2>&1; do
  i=$((i + 1)); [ $i -lt 200 ] || { cat /tmp/kvnode.log; echo "FAIL: the installed daemon did not answer"; exit 1; }
  sleep 0.1
done
[ "$(stat -c %U /run/kvnode/kvnode.sock)" = kvnode ] || { echo "FAIL: the socket is not the kvnode user'"'"'s"; exit 1; }
[ "$(ls -A /run/kvnode)" = kvnode.sock ] || { echo "FAIL: /run/kvnode holds more than the client socket: $(ls -A /run/kvnode)"; exit 1; }
[ -S /run/kvnode-admin/kvnode.sock.takeover ] && [ "$(stat -c %U:%a /run/kvnode-admin)" = kvnode:700 ] ||
  { echo "FAIL: no takeover socket in a 0700 /run/kvnode-admin: $(stat -c %U:%a /run/kvnode-admin)"; exit 1; }
[ "$(stat -c %U /proc/$pid)" = kvnode ] || { echo "FAIL: the daemon does not run as kvnode"; exit 1; }
k="--tokens $(seq -s, 1 128) --model deb --page-size 64 --page-bytes 64KiB"
/usr/bin/kvnode put --socket /run/kvnode/kvnode.sock $k --seed 3 | grep -q "^stored 2" || { echo "FAIL: put"; exit 1; }
/usr/bin/kvnode get --socket /run/kvnode/kvnode.sock $k | grep -q "^2 of 2 leading pages hit" || { echo "FAIL: get"; exit 1; }
kill -TERM $pid
wait $pid || { cat /tmp/kvnode.log; echo "FAIL: exit status $? on SIGTERM"; exit 1; }
grep -q "kvnode stopped" /tmp/kvnode.log || { cat /tmp/kvnode.log; echo "FAIL: no clean stop on SIGTERM"; exit 1; }
' >&2 || fail "the installed daemon (see above)"
step "dpkg --purge"
in_ctr dpkg --purge kvnode >&2 || fail "dpkg --purge failed"
left=$(in_ctr sh -c 'for p in /usr/bin/kvnode /usr/bin/kvtrace /lib/systemd/system/kvnode.service /etc/kvnode /var/lib/kvnode; do [ -e $p ] && echo $p; done; getent passwd kvnode; getent group kvnode; true')
[ -z "$left" ] || fail "left after purge: $left"
echo "ok: deb $(basename "$deb") ($(du -h "$deb" | cut -f1))"
