"""The slow-disk arm's throttle (harness/throttle.py, DiskThrottle): the whole-disk device under a
path, the cgroup files it writes (v1 and v2, on a fake cgroup root: no side effects), and on a
host with root and a blkio/io controller a real limit: a `dd iflag=direct` child held to
16 MB/s, then everything undone (the limit, the cgroup, the process back where it was)."""

import os
import subprocess
import time

import pytest

from harness import throttle

DiskThrottle, ThrottleError = throttle.DiskThrottle, throttle.ThrottleError

MB = 1_000_000


def _block_dir() -> str:
    """A directory on a real block device (not tmpfs), or skip."""
    for d in ("/var/tmp", os.path.expanduser("~"), "/tmp"):
        try:
            throttle.disk_of(d)
            return d
        except ThrottleError:
            continue
    pytest.skip("no directory on a block device here")


def disk_of_names_the_whole_disk_under_a_path():
    d = _block_dir()
    dev = throttle.disk_of(d)
    maj, mn = (int(x) for x in dev.split(":"))
    sys_dir = f"/sys/dev/block/{maj}:{mn}"
    assert os.path.isdir(sys_dir)
    assert not os.path.exists(os.path.join(sys_dir, "partition")), "a partition, not its disk"
    st = os.stat(d)
    if os.path.exists(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/partition"):
        assert (maj, mn) != (os.major(st.st_dev), os.minor(st.st_dev))


def disk_of_refuses_a_file_system_without_a_block_device():
    for d in ("/dev/shm", "/proc"):
        if os.path.isdir(d):
            with pytest.raises(ThrottleError, match="no block device"):
                throttle.disk_of(d)
            return
    pytest.skip("no tmpfs or procfs mounted")


def _child():
    return subprocess.Popen(["sleep", "60"])


def v2_writes_io_max_and_moves_the_pid_on_a_fake_root(tmp_path):
    d = _block_dir()
    (tmp_path / "cgroup.controllers").write_text("cpu io memory\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "cgroup.procs").write_text("")
    p = _child()
    try:
        th = DiskThrottle(p.pid, d, 20e6, root=str(tmp_path))
        th.up()
        dev = throttle.disk_of(d)
        assert th.v2 and th.dir.startswith(str(tmp_path))
        assert (tmp_path / "cgroup.subtree_control").read_text() == "+io"
        assert open(os.path.join(th.dir, "io.max")).read() == f"{dev} rbps=20000000"
        assert open(os.path.join(th.dir, "cgroup.procs")).read() == str(p.pid)
        assert th.limit() == 20_000_000
        desc = th.describe()
        assert desc["cgroup_version"] == 2 and desc["device"] == dev and desc["read_bps"] == 20_000_000
        cg = th.dir
        th.down()
        assert open(os.path.join(cg, "io.max")).read() == f"{dev} rbps=max"
        assert (tmp_path / "cgroup.procs").read_text() == str(p.pid), "moved back to its cgroup"
    finally:
        p.kill()
        p.wait()


def v1_writes_read_bps_device_on_a_fake_root(tmp_path):
    d = _block_dir()
    v1 = tmp_path / "blkio"
    v1.mkdir()
    (v1 / "blkio.throttle.read_bps_device").write_text("")
    (v1 / "cgroup.procs").write_text("")
    p = _child()
    try:
        th = DiskThrottle(p.pid, d, 1.2e9, root=str(tmp_path))
        th.up()
        dev = throttle.disk_of(d)
        assert not th.v2 and th.dir.startswith(str(v1))
        assert open(os.path.join(th.dir, "blkio.throttle.read_bps_device")).read() == f"{dev} 1200000000"
        assert th.limit() == 1_200_000_000 and th.line(None) == f"{dev} 0"
        cg = th.dir
        th.down()
        assert open(os.path.join(cg, "blkio.throttle.read_bps_device")).read() == f"{dev} 0"
        assert (v1 / "cgroup.procs").read_text() == str(p.pid)
    finally:
        p.kill()
        p.wait()


def no_controller_is_a_throttle_error_and_leaves_nothing(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    p = _child()
    try:
        with pytest.raises(ThrottleError, match="no blkio"):
            DiskThrottle(p.pid, _block_dir(), 1e9, root=str(tmp_path)).up()
        assert sorted(os.listdir(tmp_path)) == ["cgroup.controllers"]
    finally:
        p.kill()
        p.wait()


def _cgroup_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def a_real_limit_holds_direct_reads_to_the_rate_and_is_undone():
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups)")
    d = _block_dir()
    f = os.path.join(d, f"kvnode-ttft-throttle-test-{os.getpid()}")
    size = 48 << 20
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={size >> 20}", "oflag=direct"],
                   check=True, capture_output=True)
    # A shell that waits, reads the file with O_DIRECT (its dd child is in the shell's cgroup),
    # says so, and waits again: alive through the tear-down, so its way back can be checked.
    sh = subprocess.Popen(["sh", "-c", f"read _; dd if={f} of=/dev/null bs=1M iflag=direct 2>&1; echo done; read _"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    before = _cgroup_of(sh.pid)
    rate = 16 * MB
    th = DiskThrottle(sh.pid, d, rate)
    try:
        try:
            th.up()
        except ThrottleError as e:
            pytest.skip(f"no disk throttle on this host: {e}")
        name = os.path.basename(th.dir)
        assert name in _cgroup_of(sh.pid)
        assert th.limit() == rate
        t = time.perf_counter()
        sh.stdin.write("\n")
        sh.stdin.flush()
        out = []
        for line in sh.stdout:
            out.append(line)
            if line.strip() == "done":
                break
        el = time.perf_counter() - t
        want = size / rate  # 3.1 s
        assert el >= 0.8 * want, (el, out)
        assert el < 4 * want, (el, out)
        got = th.describe()
        assert got["read_bytes"] >= size, got
        cg = th.dir
        th.down()
        assert th.dir is None and not os.path.exists(cg)
        assert _cgroup_of(sh.pid) == before
        assert name not in _cgroup_of(sh.pid)
    finally:
        th.down()
        sh.kill()
        sh.wait()
        os.unlink(f)
