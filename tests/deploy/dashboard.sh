#!/usr/bin/env bash
# Every metric the Grafana dashboard (deploy/grafana/kvnode-dashboard.json) queries exists in a
# real daemon's /metrics. The daemon runs every subsystem the dashboard shows: a spill tier,
# peer service, cluster membership (etcd down: the cluster gauges are exported all the same),
# a tenant map with quotas; a put, a get, a miss and a spill happen first, so per-label series
# have samples. A metric counts as present when /metrics has a sample of it (histograms: its
# _bucket/_count/_sum) or, for a labelled family with no label set yet, its TYPE line.
source "$(dirname "$0")/lib.sh"
dir=$(scratch dashboard)
daemon=
cleanup() { [ -n "$daemon" ] && kill "$daemon" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
mport=$(free_port)
pport=$(free_port)
head -c 32 /dev/urandom | base64 >"$dir/cluster.key"
cat >"$dir/kvnode.toml" <<TOML
socket = "$dir/kvnode.sock"
dram = "16MiB"
slab_size = "2MiB"
pin = false
metrics = "127.0.0.1:$mport"
[tenants]
unmapped = "default"
[[tenants.tenant]]
name = "t1"
uids = [$(id -u)]
dram_quota = "12MiB"
[[spill.dirs]]
path = "$dir/spill"
size = "64MiB"
[peer]
listen = "127.0.0.1:$pport"
cluster_key = "$dir/cluster.key"
[cluster]
etcd = "etcd://127.0.0.1:1/dashboard"
node_id = "dash"
TOML
"$KVNODE" serve --config "$dir/kvnode.toml" 2>"$dir/daemon.log" &
daemon=$!
wait_socket "$dir/kvnode.sock" || { cat "$dir/daemon.log" >&2; fail "daemon did not start"; }
keys=(--socket "$dir/kvnode.sock" --model dash --page-size 64 --page-bytes 1MiB)
# 24 MiB into a 16 MiB tier: demotions to NVMe; then a get (hits) and a miss.
"$KVNODE" put "${keys[@]}" --tokens "$(seq -s, 1 1536)" --seed 1 >/dev/null
"$KVNODE" get "${keys[@]}" --tokens "$(seq -s, 1 1536)" >/dev/null
"$KVNODE" get "${keys[@]}" --tokens "$(seq -s, 5000 5063)" >/dev/null
http_get "127.0.0.1:$mport/metrics" >"$dir/metrics.txt" || fail "/metrics does not answer"
python3 - "$ROOT/deploy/grafana/kvnode-dashboard.json" "$dir/metrics.txt" <<'PY'
import json, re, sys
dash = json.load(open(sys.argv[1]))
text = open(sys.argv[2]).read()
samples = {l.split("{")[0].split(" ")[0] for l in text.splitlines() if l and not l.startswith("#")}
types = {l.split()[2]: l.split()[3] for l in text.splitlines() if l.startswith("# TYPE ")}
def panels(ps):
    for p in ps:
        yield p
        yield from panels(p.get("panels", []))
exprs = [t["expr"] for p in panels(dash["panels"]) for t in p.get("targets", [])]
exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
names = sorted({m for e in exprs for m in re.findall(r"\bkvnode_[a-z0-9_]+", e)})
assert len(exprs) >= 20 and len(names) >= 30, (len(exprs), len(names))
def present(n):
    if n in samples:
        return True
    fam = re.sub(r"_(bucket|count|sum)$", "", n)
    if n.endswith(("_bucket", "_count", "_sum")):
        return types.get(fam) == "histogram"
    return n in types or re.sub(r"_total$", "", n) in types
# The check sees a missing name (it is not a no-op).
assert not present("kvnode_tier_hits_totl") and not present("kvnode_op_latency_seconds_buckets")
missing = [n for n in names if not present(n)]
print(f"dashboard: {len(exprs)} queries over {len(names)} metrics; {len(names) - len(missing)} in /metrics")
if missing:
    print("missing from /metrics:", missing)
    sys.exit(1)
PY
echo "ok: dashboard"
