#!/usr/bin/env python3
"""One row per run of device.sh's raw-*.txt: who, blocks, flags, service gap and where it fell
against the barrier (the donor's "draining" log line, ms after the successor's spawn), the
successor's build, heap per block and single-key latency (--probes)."""
import datetime, re, sys

def ts(stamp):
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

for path in sys.argv[1:]:
    runs = open(path).read().split("\n== ")
    for r in runs:
        m = re.match(r"(new|old) (\d+) blocks, mode (\w+)", r)
        if not m:
            continue
        who, n, mode = m.groups()
        flags = re.search(r"--daemon \w+ ?(.*)", r).group(1)
        gap = re.search(r"service gap ([\d.]+) ms \(at (\d+) ms", r)
        spawn = re.search(r"successor spawned at unix ([\d.]+)", r)
        drain = re.search(r"  log: (\S+) .*takeover: draining in-flight", r)
        took = re.search(r"  log: (\S+) .*took over the DRAM tier", r)
        built = re.search(r"built the DRAM tier from the live image .*elapsed_ms=(\d+)", r)
        heap = re.search(r"fill, [\d]+ before: ([\d.]+) bytes per block", r)
        lat = re.search(r"exists p50 ([\d.]+) us p99 ([\d.]+) us; get p50 ([\d.]+) us p99 ([\d.]+) us; put p50 ([\d.]+) us p99 ([\d.]+) us", r)
        row = [path.split("/")[-1], who, n, flags.replace("--load-clients 2", "").strip() or "-"]
        row.append(f"{gap.group(1)} ms at {gap.group(2)}" if gap else "-")
        if spawn and drain and took:
            s = float(spawn.group(1))
            row.append(f"barrier {(ts(drain.group(1)) - s) * 1e3:.0f}..{(ts(took.group(1)) - s) * 1e3:.0f} ms")
        else:
            row.append("-")
        row.append(f"build {built.group(1)} ms" if built else "-")
        row.append(f"{heap.group(1)} B/block" if heap else "-")
        row.append("exists %s/%s get %s/%s put %s/%s us" % lat.groups() if lat else "-")
        print(" | ".join(row))
