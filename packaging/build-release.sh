#!/usr/bin/env bash
# Builds the binaries kvnode ships (the image, scripts/build-image.sh; the .deb,
# packaging/deb/build-deb.sh) and proves they carry no test seams; prints the directory that
# holds kvnode and kvtrace.
#
# Why a target dir of its own (target/package): `cargo build --workspace` (the test build)
# turns the engine's `test-seams` feature on by feature unification, and the daemon it leaves in
# target/release then obeys KVNODE_TEST_FAKE_GPU (any client reads and writes files as the
# daemon's uid), fault-injection sections and a panic hook. Packaging whatever target/release
# holds would ship that. Here the daemon is built alone (-p kvnode -p kvtrace) where no test
# build ever writes, then probed (`cargo xtask release-seams BIN`: the fake GPU's switch
# KVNODE_TEST_FAKE_GPU absent from the binary's bytes, fault sections refused, panic hook
# ignored). A seam build would not serve anyway: it refuses to start without
# KVNODE_TEST_SEAMS=1 (engine/daemon/src/seams.rs).
# Usage: packaging/build-release.sh   (KVNODE_PACKAGE_TARGET overrides target/package)
set -euo pipefail
cd "$(dirname "$0")/.."
target=${KVNODE_PACKAGE_TARGET:-target/package}
cargo build --release -p kvnode -p kvtrace --target-dir "$target" >&2
cargo xtask release-seams "$target/release/kvnode" >&2
(cd "$target/release" && pwd)
