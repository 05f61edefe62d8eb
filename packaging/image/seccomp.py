#!/usr/bin/env python3
"""Writes a seccomp profile for the kvnode container: a runtime's default profile plus the
three io_uring system calls the spill tier needs (io_uring_setup, io_uring_enter,
io_uring_register). Default container profiles refuse io_uring (ENOSYS), and the daemon then
cannot open its spill tier. Everything else the default refuses stays refused.

  packaging/image/seccomp.py [DEFAULT.json] > kvnode-seccomp.json
  podman run --security-opt seccomp=kvnode-seccomp.json ...

DEFAULT.json defaults to podman's /usr/share/containers/seccomp.json (Debian's
containers-common). For Kubernetes, install the output on every node as
/var/lib/kubelet/seccomp/kvnode.json and set the DaemonSet's seccompProfile to
{type: Localhost, localhostProfile: kvnode.json} (docs/deploy.md).
"""

import json
import sys

URING = ["io_uring_setup", "io_uring_enter", "io_uring_register"]


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/containers/seccomp.json"
    with open(src) as f:
        prof = json.load(f)
    if prof.get("defaultAction") == "SCMP_ACT_ALLOW":
        sys.exit(f"{src} allows every system call by default: nothing to add")
    prof["syscalls"].append({"names": URING, "action": "SCMP_ACT_ALLOW",
                             "comment": "kvnode spill tier (io_uring, O_DIRECT)"})
    json.dump(prof, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
