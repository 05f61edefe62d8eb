"""Validates deploy/ and checks the invariants that bind its files (docs/deploy.md).

1. Every Kubernetes object under deploy/ (base, engines, the gpu overlay merged onto the base
   DaemonSet) validates with kubernetes-validate against the pinned Kubernetes version
   (strict: unknown fields are errors). The ServiceMonitor (a CRD) validates against
   deploy/schemas/servicemonitor.schema.json, the subset of prometheus-operator's CRD it uses.
2. The invariants (`violations`): socket path, cluster-key path, ports, spill paths, memory
   sized from `dram`, takeover-ready rolling update, user/groups, the image's defaults; engine
   pods non-root at distinct uids the tenant map names, the socket dir mounted read-only, the
   takeover socket's directory apart and mounted by no engine pod.
3. Each invariant is seen to fail: copies of deploy/ with one path, port or size changed
   (MUTATIONS) must each be refused with that invariant's message.

Run with the deploy venv (scripts/install-deploy-deps.sh): python tests/deploy/manifests.py
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.33.0"
ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def load_tree(root: Path) -> dict:
    """Every YAML document under root/deploy, by file (relative path -> list of docs)."""
    out = {}
    for p in sorted((root / "deploy").rglob("*.yaml")):
        out[str(p.relative_to(root))] = [d for d in yaml.safe_load_all(p.read_text()) if d]
    return out


def one(tree: dict, kind: str, file: str | None = None) -> dict:
    docs = [d for f, ds in tree.items() if file in (None, f) for d in ds if d.get("kind") == kind]
    assert len(docs) == 1, f"expected one {kind} in {file or 'deploy/'}, found {len(docs)}"
    return docs[0]


def merge(base, patch):
    """Strategic-merge subset: maps merge, lists of named maps merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(
        isinstance(x, dict) and "name" in x for x in base + patch
    ):
        out = [dict(x) for x in base]
        for x in patch:
            i = next((i for i, b in enumerate(out) if b["name"] == x["name"]), None)
            if i is None:
                out.append(x)
            else:
                out[i] = merge(out[i], x)
        return out
    return patch


def quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": GIB, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(q))
    assert m, f"unsupported quantity {q!r}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": GIB, "TiB": 1 << 40}
    m = re.fullmatch(r"(\d+)(KiB|MiB|GiB|TiB)", s)
    assert m, f"unsupported size {s!r}"
    return int(m.group(1)) * units[m.group(2)]


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def validate_schemas(root: Path, tree: dict) -> list[str]:
    errors = []
    sm_schema = json.loads((root / "deploy/schemas/servicemonitor.schema.json").read_text())
    base_ds = one(tree, "DaemonSet", "deploy/base/daemonset.yaml")
    docs = []
    for f, ds in tree.items():
        for d in ds:
            if d.get("kind") == "Kustomization":
                continue
            if f.startswith("deploy/overlays/"):
                d = merge(base_ds, d)  # a patch: validate what it makes
            docs.append((f, d))
    for f, d in docs:
        try:
            if d.get("apiVersion") == "monitoring.coreos.com/v1":
                jsonschema.validate(d, sm_schema)
            else:
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except Exception as e:  # noqa: BLE001 - every validator error is a finding
            errors.append(f"{f}: {d.get('kind')} {d['metadata'].get('name')}: {e}")
    return errors


ENGINE_PODS = ("deploy/engines/vllm-pod.yaml", "deploy/engines/sglang-pod.yaml")


def engine_pods(tree: dict, cfg: dict, vols: dict, ctr: dict, pod: dict, need) -> None:
    """Engines can neither reach the takeover socket nor replace the client socket, and each
    runs as a uid of its own that the tenant map names (issue 38: a root engine beside a
    writable socket directory took the arena over)."""
    socket = Path(cfg["socket"])
    takeover = Path(cfg.get("takeover_socket") or f"{socket.parent}-admin/{socket.name}.takeover")
    need(takeover.parent != socket.parent, f"takeover: takeover_socket {takeover} is in the client socket's directory {socket.parent}")
    host_of = lambda m: vols.get(m["name"], {}).get("hostPath", {}).get("path")  # noqa: E731
    tm = next((m for m in ctr["volumeMounts"] if Path(m["mountPath"]) == takeover.parent), None)
    host_takeover = host_of(tm) if tm else None
    sm = next((m for m in ctr["volumeMounts"] if Path(m["mountPath"]) == socket.parent), None)
    need(host_takeover is not None and host_takeover != (host_of(sm) if sm else None),
         f"takeover: the DaemonSet mounts no hostPath of its own at {takeover.parent} (the takeover socket's directory)")
    init = " ".join(" ".join(c.get("command", [])) for c in pod.get("initContainers", []))
    need(f"chmod 0700 {takeover.parent}" in init, f"takeover: no init container makes {takeover.parent} 0700")
    daemon_uid = pod["securityContext"].get("runAsUser")
    tenant_uids = {u: t["name"] for t in cfg.get("tenants", {}).get("tenant", []) for u in t.get("uids", [])}
    seen = {}
    for f in ENGINE_PODS:
        epod = one(tree, "Pod", f)["spec"]
        (ec,) = epod["containers"]
        evols = {x["name"]: x for x in epod["volumes"]}
        sc = epod.get("securityContext", {})
        uid = ec.get("securityContext", {}).get("runAsUser", sc.get("runAsUser"))
        need(isinstance(uid, int) and uid != 0 and (ec.get("securityContext", {}).get("runAsNonRoot") or sc.get("runAsNonRoot")),
             f"engines: {f} runs as root or without runAsNonRoot (runAsUser {uid})")
        need(uid != daemon_uid, f"engines: {f} runs as the daemon's uid {daemon_uid}")
        need(uid not in seen, f"engines: {f} shares uid {uid} with {seen.get(uid)}: one tenant to the daemon")
        seen[uid] = f
        if tenant_uids:
            need(uid in tenant_uids, f"engines: {f}: uid {uid} is no tenant's in the ConfigMap's [tenants]")
        esc = ec.get("securityContext", {})
        need(esc.get("allowPrivilegeEscalation") is False and esc.get("capabilities", {}).get("drop") == ["ALL"],
             f"engines: {f} may escalate privileges or keeps capabilities")
        for m in ec["volumeMounts"]:
            hp = evols[m["name"]].get("hostPath", {}).get("path")
            need(hp != host_takeover, f"engines: {f} mounts the takeover directory {hp}")
            if hp is not None and hp == (host_of(sm) if sm else None):
                need(m.get("readOnly") is True, f"engines: {f} mounts the socket dir {hp} writable (a relay could replace the socket)")


def violations(root: Path) -> list[str]:
    """What breaks the contract between the manifests, the image and the engines."""
    tree = load_tree(root)
    v = []

    def need(cond, msg):
        if not cond:
            v.append(msg)

    cm = one(tree, "ConfigMap", "deploy/base/configmap.yaml")
    cfg = tomllib.loads(cm["data"]["kvnode.toml"])
    ds = one(tree, "DaemonSet", "deploy/base/daemonset.yaml")
    pod = ds["spec"]["template"]["spec"]
    (ctr,) = [c for c in pod["containers"] if c["name"] == "kvnode"]
    vols = {x["name"]: x for x in pod["volumes"]}
    mounts = {m["name"]: m for m in ctr["volumeMounts"]}
    socket = Path(cfg["socket"])

    # Kustomization: every file of base is a resource, every resource a file.
    kz = yaml.safe_load((root / "deploy/base/kustomization.yaml").read_text())
    files = {p.name for p in (root / "deploy/base").glob("*.yaml")} - {"kustomization.yaml"}
    need(set(kz["resources"]) == files, f"kustomization: resources {sorted(kz['resources'])} != files {sorted(files)}")
    version = re.search(r'^version = "(.*)"', (root / "Cargo.toml").read_text(), re.M).group(1)
    need(all(i.get("newTag") == version for i in kz.get("images", [])), f"kustomization: image tag is not the crate version {version}")

    # Socket: the daemon's socket dir is the node's hostPath, and every engine uses that path.
    sock_mount = next((m for m in ctr["volumeMounts"] if Path(m["mountPath"]) == socket.parent), None)
    need(sock_mount is not None, f"socket: no volume mounted at {socket.parent} (the config's socket dir) in the DaemonSet")
    host_sock_dir = vols.get(sock_mount["name"], {}).get("hostPath", {}).get("path") if sock_mount else None
    need(host_sock_dir is not None, "socket: the DaemonSet's socket dir is not a hostPath")
    image_cfg = tomllib.loads((root / "packaging/image/kvnode.toml").read_text())
    need(image_cfg["socket"] == str(socket), f"socket: the image's default {image_cfg['socket']} != the ConfigMap's {socket}")
    containerfile = (root / "packaging/image/Containerfile").read_text()
    need(f"ENV KVNODE_SOCKET={socket}" in containerfile, f"socket: the image's KVNODE_SOCKET is not {socket}")
    need((cfg.get("socket_mode", 0o660) & 0o060) == 0o060, "socket: socket_mode does not let the kvnode group connect")
    for f in ("deploy/engines/vllm-pod.yaml", "deploy/engines/sglang-pod.yaml"):
        epod = one(tree, "Pod", f)["spec"]
        (ec,) = epod["containers"]
        evols = {x["name"]: x for x in epod["volumes"]}
        em = [m for m in ec["volumeMounts"] if evols[m["name"]].get("hostPath", {}).get("path") == host_sock_dir]
        need(len(em) == 1, f"socket: {f} does not mount the node's socket dir {host_sock_dir}")
        need(bool(em) and Path(em[0]["mountPath"]) == socket.parent, f"socket: {f} mounts the socket dir elsewhere than {socket.parent}")
        env = {e["name"]: e.get("value") for e in ec.get("env", [])}
        need(env.get("KVNODE_SOCKET") == str(socket), f"socket: {f}: KVNODE_SOCKET is not {socket}")
        configs = [json.loads(a) for a in ec["args"] if a.startswith("{")]
        socks = [c.get("socket") or c.get("kv_connector_extra_config", {}).get("socket") for c in configs]
        need(socks == [str(socket)], f"socket: {f}: the connector's socket {socks} is not {socket}")
        need(10001 in epod.get("securityContext", {}).get("supplementalGroups", []), f"socket: {f} is not in the kvnode group 10001")

    engine_pods(tree, cfg, vols, ctr, pod, need)

    # Cluster key: the Secret's file, where the DaemonSet mounts it, is the config's cluster_key.
    secret = one(tree, "Secret", "deploy/base/secret.yaml")
    key_vol = next((n for n, x in vols.items() if x.get("secret", {}).get("secretName") == secret["metadata"]["name"]), None)
    need(key_vol is not None, f"cluster key: no volume of the Secret {secret['metadata']['name']}")
    key_paths = {str(Path(mounts[key_vol]["mountPath"]) / k) for k in secret["data"]} if key_vol in mounts else set()
    need(cfg["peer"]["cluster_key"] in key_paths, f"cluster key: cluster_key {cfg['peer']['cluster_key']} is not the Secret's file {sorted(key_paths)}")
    need(vols.get(key_vol, {}).get("secret", {}).get("defaultMode", 0o644) & 0o040 and pod["securityContext"].get("fsGroup") == 10001,
         "cluster key: the Secret's file is not readable by the kvnode group (defaultMode 0440 + fsGroup 10001)")

    # Ports: config <-> container ports <-> advertise <-> probe <-> Service <-> ServiceMonitor.
    cports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    need(cports.get("peer") == port_of(cfg["peer"]["listen"]), f"ports: peer containerPort {cports.get('peer')} != [peer] listen {cfg['peer']['listen']}")
    adv = [a for a in ctr["args"] if a.startswith("tcp://")]
    need(len(adv) == 1 and port_of(adv[0]) == port_of(cfg["peer"]["listen"]), f"ports: --advertise {adv} is not the peer port")
    need(cports.get("metrics") == port_of(cfg["metrics"]), f"ports: metrics containerPort {cports.get('metrics')} != metrics {cfg['metrics']}")
    need(ctr["readinessProbe"]["httpGet"]["port"] in ("metrics", cports.get("metrics")), "ports: the readiness probe is not the metrics port")
    svc = one(tree, "Service", "deploy/base/service.yaml")
    (sp,) = svc["spec"]["ports"]
    need(sp["targetPort"] in cports or sp["targetPort"] == cports.get("metrics"), f"ports: Service targetPort {sp['targetPort']} is no container port")
    tmpl_labels = ds["spec"]["template"]["metadata"]["labels"]
    need(all(tmpl_labels.get(k) == x for k, x in svc["spec"]["selector"].items()), "labels: the Service selects no kvnode pod")
    need(all(tmpl_labels.get(k) == x for k, x in ds["spec"]["selector"]["matchLabels"].items()), "labels: the DaemonSet selector does not match its pods")
    sm = one(tree, "ServiceMonitor", "deploy/base/servicemonitor.yaml")
    need([e["port"] for e in sm["spec"]["endpoints"]] == [sp["name"]], "ports: the ServiceMonitor does not scrape the Service's metrics port")
    need(all(svc["metadata"]["labels"].get(k) == x for k, x in sm["spec"]["selector"]["matchLabels"].items()), "labels: the ServiceMonitor selects no Service")

    # Cluster: --cluster is the ConfigMap's etcd URL, --node-id the node's name.
    envs = {e["name"]: e for e in ctr["env"]}
    cl = [ctr["args"][i + 1] for i, a in enumerate(ctr["args"][:-1]) if a == "--cluster"]
    ref = envs.get(cl[0][2:-1], {}).get("valueFrom", {}).get("configMapKeyRef", {}) if cl and cl[0].startswith("$(") else {}
    need(ref.get("name") == cm["metadata"]["name"] and ref.get("key") in cm["data"] and cm["data"].get(ref.get("key"), "").startswith(("etcd://", "etcds://")),
         f"cluster: --cluster {cl} is not the ConfigMap's etcd URL")
    nid = [ctr["args"][i + 1] for i, a in enumerate(ctr["args"][:-1]) if a == "--node-id"]
    need(bool(nid) and envs.get(nid[0][2:-1], {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName",
         "cluster: --node-id is not the node's name (spec.nodeName)")

    # Spill: every spill dir is on a hostPath mount.
    for d in cfg.get("spill", {}).get("dirs", []):
        m = next((m for m in ctr["volumeMounts"] if Path(d["path"]) == Path(m["mountPath"]) or Path(m["mountPath"]) in Path(d["path"]).parents), None)
        need(m is not None and "hostPath" in vols.get(m["name"], {}), f"spill: {d['path']} is not on a hostPath volume")

    # Memory sized from dram; the stop budget covers drain + flush.
    res = ctr["resources"]
    want = size(cfg["dram"]) + GIB
    need(quantity(res["requests"]["memory"]) == want and quantity(res["limits"]["memory"]) == want,
         f"resources: memory request/limit {res['requests']['memory']}/{res['limits']['memory']} != dram {cfg['dram']} + 1Gi")
    budget = cfg.get("drain_timeout_s", 5) + cfg.get("spill", {}).get("flush_on_stop_s", 60) + 10
    need(pod["terminationGracePeriodSeconds"] >= budget, f"stop: terminationGracePeriodSeconds < drain + flush + 10 s ({budget})")

    # Upgrades by takeover: surge beside the old pod, --takeover, same user; IPC_LOCK only.
    ru = ds["spec"]["updateStrategy"]["rollingUpdate"]
    need(ru.get("maxSurge") == 1 and ru.get("maxUnavailable") == 0, "update: not maxSurge 1 / maxUnavailable 0")
    need("--takeover" in ctr["args"], "update: the daemon is not started with --takeover")
    user = re.search(r"^USER (\d+):(\d+)$", containerfile, re.M)
    need(user is not None and pod["securityContext"].get("runAsUser") == int(user.group(1)), "user: the DaemonSet's runAsUser is not the image's USER")
    caps = ctr["securityContext"]["capabilities"]
    need(caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, f"capabilities: {caps} is not drop ALL + IPC_LOCK")
    state = [m for m in ctr["volumeMounts"] if m["mountPath"] == next((e["value"] for e in ctr["env"] if e["name"] == "KVNODE_POD_STATE"), None)]
    need(len(state) == 1 and "emptyDir" in vols[state[0]["name"]], "update: KVNODE_POD_STATE is not an emptyDir (a restarted old pod would take the tier back)")
    return v


# (file, old text, new text, the message a violation must contain)
MUTATIONS = [
    ("deploy/engines/vllm-pod.yaml", "mountPath: /run/kvnode", "mountPath: /run/kvnode-x", "socket: deploy/engines/vllm-pod.yaml mounts"),
    ("deploy/engines/sglang-pod.yaml", '"socket": "/run/kvnode/kvnode.sock"', '"socket": "/run/kv/kvnode.sock"', "socket: deploy/engines/sglang-pod.yaml: the connector"),
    ("deploy/engines/sglang-pod.yaml", "path: /run/kvnode", "path: /var/run/kvnode", "socket: deploy/engines/sglang-pod.yaml does not mount"),
    ("deploy/base/configmap.yaml", 'socket = "/run/kvnode/kvnode.sock"', 'socket = "/run/kvnode2/kvnode.sock"', "socket: no volume mounted"),
    ("deploy/base/daemonset.yaml", "mountPath: /etc/kvnode/secret", "mountPath: /etc/kvnode/keys", "cluster key: cluster_key"),
    ("deploy/base/configmap.yaml", 'cluster_key = "/etc/kvnode/secret/cluster.key"', 'cluster_key = "/etc/kvnode/cluster.key"', "cluster key: cluster_key"),
    ("deploy/base/configmap.yaml", 'listen = "0.0.0.0:7700"', 'listen = "0.0.0.0:7701"', "ports: peer containerPort"),
    ("deploy/base/configmap.yaml", 'metrics = "0.0.0.0:9400"', 'metrics = "0.0.0.0:9500"', "ports: metrics containerPort"),
    ("deploy/base/servicemonitor.yaml", "- port: metrics", "- port: http-metrics", "ports: the ServiceMonitor"),
    ("deploy/base/configmap.yaml", 'dram = "16GiB"', 'dram = "32GiB"', "resources: memory"),
    ("deploy/base/configmap.yaml", 'path = "/var/lib/kvnode/spill"', 'path = "/var/lib/spill"', "spill: /var/lib/spill"),
    ("deploy/base/daemonset.yaml", "maxSurge: 1", "maxSurge: 0", "update: not maxSurge 1"),
    ("deploy/base/daemonset.yaml", "            - --takeover\n", "", "update: the daemon is not started with --takeover"),
    ("deploy/base/configmap.yaml", "  etcd: ", "  etcd_url: ", "cluster: --cluster"),
    ("deploy/base/daemonset.yaml", "fieldPath: spec.nodeName", "fieldPath: metadata.name", "cluster: --node-id"),
    ("packaging/image/kvnode.toml", 'socket = "/run/kvnode/kvnode.sock"', 'socket = "/tmp/kvnode.sock"', "socket: the image's default"),
    ("deploy/engines/vllm-pod.yaml", "runAsUser: 20001", "runAsUser: 0", "engines: deploy/engines/vllm-pod.yaml runs as root"),
    ("deploy/engines/sglang-pod.yaml", "runAsUser: 20002", "runAsUser: 20001", "engines: deploy/engines/sglang-pod.yaml shares uid 20001"),
    ("deploy/engines/vllm-pod.yaml", "          readOnly: true\n", "", "engines: deploy/engines/vllm-pod.yaml mounts the socket dir"),
    ("deploy/engines/sglang-pod.yaml", "path: /run/kvnode\n", "path: /run/kvnode-admin\n", "engines: deploy/engines/sglang-pod.yaml mounts the takeover directory"),
    ("deploy/engines/vllm-pod.yaml", "allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true", "engines: deploy/engines/vllm-pod.yaml may escalate"),
    ("deploy/base/configmap.yaml", "uids = [20002]", "uids = [20003]", "engines: deploy/engines/sglang-pod.yaml: uid 20002 is no tenant's"),
    ("deploy/base/configmap.yaml", 'takeover_socket = "/run/kvnode-admin/kvnode.sock.takeover"', 'takeover_socket = "/run/kvnode/kvnode.sock.takeover"', "takeover: takeover_socket"),
    ("deploy/base/daemonset.yaml", "chmod 0700 /run/kvnode-admin", "chmod 0750 /run/kvnode-admin", "takeover: no init container"),
]


def mutated_copy(file: str, old: str, new: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="kvnode-manifests-"))
    for part in ("deploy", "packaging/image"):
        shutil.copytree(ROOT / part, tmp / part)
    shutil.copy(ROOT / "Cargo.toml", tmp / "Cargo.toml")
    p = tmp / file
    text = p.read_text()
    assert old in text, f"mutation: {old!r} not in {file}"
    p.write_text(text.replace(old, new))
    return tmp


def main() -> int:
    failed = 0
    tree = load_tree(ROOT)
    errs = validate_schemas(ROOT, tree)
    n = sum(len(d) for d in tree.values())
    for e in errs:
        print(f"FAIL validate: {e}")
    print(f"{'ok' if not errs else 'FAIL'}: {n} documents under deploy/ against Kubernetes {K8S_VERSION} (strict)")
    failed += bool(errs)
    bad = violations(ROOT)
    for e in bad:
        print(f"FAIL invariant: {e}")
    print(f"{'ok' if not bad else 'FAIL'}: invariants of deploy/")
    failed += bool(bad)
    for file, old, new, want in MUTATIONS:
        tmp = mutated_copy(file, old, new)
        try:
            got = violations(tmp)
        finally:
            shutil.rmtree(tmp)
        hit = [g for g in got if want in g]
        print(f"{'ok' if hit else 'FAIL'}: {file}: {old.strip()!r} -> {new.strip()!r} is refused: {hit[:1] or got}")
        failed += not hit
    # A schema error is found too (the validator is not a no-op).
    broken = copy.deepcopy(one(tree, "DaemonSet", "deploy/base/daemonset.yaml"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "7700"
    try:
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
        print("FAIL: a DaemonSet with a string containerPort validates")
        failed += 1
    except kubernetes_validate.ValidationError as e:
        print(f"ok: a string containerPort is refused ({str(e).splitlines()[0][:80]})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
