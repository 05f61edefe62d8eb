#!/usr/bin/env bash
# Installs the system packages kvnode's build, tests and benchmarks need (Debian 12).
# Idempotent: does nothing when everything is present.
set -euo pipefail
need=()
command -v cargo >/dev/null || { echo "install-deps: cargo (Rust >= 1.95) is required and missing" >&2; exit 1; }
command -v cc >/dev/null || need+=(gcc)
command -v fio >/dev/null || need+=(fio)
command -v iperf3 >/dev/null || need+=(iperf3)
# kvtrace: clang compiles the BPF programs, bpftool generates vmlinux.h, libbpf (vendored by
# libbpf-sys) links against the system libelf and zlib found through pkg-config; asm/ headers
# come from linux-libc-dev.
command -v clang >/dev/null || need+=(clang)
command -v bpftool >/dev/null || need+=(bpftool)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v make >/dev/null || need+=(make)
for pkg in libelf-dev zlib1g-dev linux-libc-dev; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if ((${#need[@]})); then
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  echo "install-deps: installing ${need[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
