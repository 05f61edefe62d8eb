#!/usr/bin/env python3
"""Summarises run.sh's raw output: per run the service gap (largest interval between answers
anywhere in the window), the barrier's interval (the listed interval that overlaps the time
from the donor's stop to the successor's take-over, else "< the smallest listed"), the
pre-copy rounds and the barrier's delta. Usage: python3 table.py raw.txt"""
import re, sys

runs, cur = [], None
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"== (\w+) (\d+) blocks", line)
    if m:
        cur = {"who": m[1], "n": int(m[2]), "rounds": "-"}
        runs.append(cur)
        continue
    if cur is None:
        continue
    if m := re.search(r"service gap ([\d.]+) ms", line):
        cur["gap"] = float(m[1])
    if line.startswith("largest intervals:"):
        cur["largest"] = [(float(a), float(b)) for a, b in re.findall(r"([\d.]+) ms at ([\d.]+) ms", line)]
    if m := re.search(r"donor stops accepting at (\d+) ms, successor took over at (\d+) ms", line):
        cur["stop"], cur["took"] = int(m[1]), int(m[2])
    if m := re.search(r"pre-copy rounds applied .* slots=\[([\d, ]+)\]", line):
        cur["rounds"] = m[1]
    if m := re.search(r"applied the slots changed .* slots=(\d+) .* elapsed_us=(\d+)", line):
        cur["delta"] = f"{m[1]} slots, {int(m[2]) / 1000:.2f} ms"

print("| blocks | build | service gap | barrier's interval | pre-copy rounds (slots) | barrier's delta (applied in) |")
print("|---|---|---|---|---|---|")
for r in runs:
    bi = "?"
    if "largest" in r and "stop" in r:
        hit = [g for g, at in r["largest"] if r["stop"] - 1 <= at + g and at <= r["took"] + 50]
        bi = f"{max(hit):.1f} ms" if hit else f"< {min(g for g, _ in r['largest']):.1f} ms"
    print(f"| {r['n']:,} | {r['who']} | {r.get('gap', float('nan')):.1f} ms | {bi} | {r['rounds']} | {r.get('delta', '?')} |")
