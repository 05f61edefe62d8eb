"""The real Dynamo indexer (PyPI `ai-dynamo-runtime` 1.6.1, `python -m dynamo.indexer`),
restarted after more than the replay ring's 10 000 batches, ends with exactly the node's blocks.

Issue 43, item 3: a router that restarts after more traffic than the ring keeps must not learn
only the new blocks. A real daemon (small DRAM tier over a spill tier, so puts evict, demote to
NVMe and NVMe evicts; deletes; gets that promote) publishes on ipc sockets with the default ring
(10 000 batches). The wheel's indexer is registered with the daemon's PUB and replay endpoints,
follows more than 10 000 batches, is killed, misses more than 10 000 more (the ring evicted
every seq it knew and seq 0), is started again and registered again. 256 hot blocks stay in
DRAM from the first batches to the end (each round reads a few; a DRAM hit publishes nothing):
their only stores are long out of the ring, so only the snapshot can tell the restarted
indexer about them (the rest of the cache churns and is re-announced within the ring). Its unchanged listener asks
the replay from seq 0, which the daemon answers with AllBlocksCleared + its residency snapshot
under S - 1, then the ring (docs/events.md, "Snapshot"). The test then requires the indexer's
`/dump` to hold exactly the daemon's blocks: per tier as many as `Stats` counts (DRAM =
`host_pinned`, NVMe = `disk`), and as a set exactly the router hashes of the blocks the daemon's
`Exists` finds, and requires the daemon's `snapshots` and `replay_requests` counters to have
moved (the recovery went through the snapshot answer).

Run: `KVNODE_TEST_SEAMS=1 $(bash scripts/py-venv.sh dynamo | tail -1) -m pytest -q
clients/python/tests_dynamo` (`./dev test` runs it; KVNODE_BIN names the daemon).
"""

import hashlib
import time
from typing import Dict, List, Set

from conftest import Daemon, Indexer
from kvnode.common import NamespaceSpec
from kvnode.wire import Connection, key

PAGE = 4            # tokens per block (the indexer's block_size)
BLOCK = 4096        # bytes per block
CHAIN = 8           # blocks per put, each the parent of the next
WORKER = 7          # the daemon's instance id at the indexer
MODEL = "kvnode-dyn"
DRAM_BLOCKS = 4096  # --dram 16MiB of BLOCK-byte slots
RING = 10_000       # the daemon's default replay ring (batches)
HOT_CHAINS = 32     # 256 blocks resident from the first batches to the end
TIERS = {"dram": "host_pinned", "nvme": "disk"}  # kvnode tier -> the indexer's storage_tier


def digest(i: int) -> bytes:
    return hashlib.sha256(b"kvnode-dynamo-%d" % i).digest()


def router_hash(i: int) -> int:
    """What the daemon publishes for block i: the digest's first 8 bytes, big-endian
    (docs/events.md, "Block hashes")."""
    return int.from_bytes(digest(i)[:8], "big")


class Node:
    """The daemon seen through one client connection: puts chains with router metadata,
    deletes, gets (promotions), and reads the daemon's own truth (Stats, Exists)."""

    def __init__(self, conn: Connection):
        self.c = conn
        self.ns = conn.register(NamespaceSpec(model=MODEL, page_size=PAGE, tenant_salt="tenant-a",
                                              segments=(BLOCK,)))["ns"]
        self.next = 0
        self.rounds = 0
        self.hot: List[int] = []

    def put(self, ids: List[int]):
        """Puts blocks `ids` as one chain: the first a root, each the parent of the next."""
        metas = [{"tokens": [i * PAGE + j for j in range(PAGE)],
                  "parent": None if n == 0 else digest(i - 1)}
                 for n, i in enumerate(ids)]
        body = {"ns": self.ns, "keys": [key(digest(i)) for i in ids], "lens": [BLOCK] * len(ids),
                "meta": metas}
        res = self.c.call({"Put": body}, payload=[i.to_bytes(8, "little") * (BLOCK // 8) for i in ids])
        assert set(res[1]["results"]) <= {"Stored", "Exists"}, res

    def put_hot(self, chains: int):
        """Puts `chains` chains that every later round keeps hot (see `round`)."""
        for _ in range(chains):
            ids = list(range(self.next, self.next + CHAIN))
            self.put(ids)
            self.hot.extend(ids)
            self.next += CHAIN

    def reconnect(self, conn: Connection):
        """Goes on through `conn` (a successor after a takeover: the namespace is kept)."""
        self.c = conn
        self.ns = conn.register(NamespaceSpec(model=MODEL, page_size=PAGE, tenant_salt="tenant-a",
                                              segments=(BLOCK,)))["ns"]

    def round(self):
        """One step of traffic: a new chain; a get of 4 hot blocks (LRU keeps them in DRAM, and
        a DRAM hit publishes nothing, so their only stores stay the first ones); every 3rd a
        delete; every 5th a get of older blocks (promotions from NVMe)."""
        self.put(list(range(self.next, self.next + CHAIN)))
        self.next += CHAIN
        self.rounds += 1
        if self.hot:
            at = (self.rounds * 4) % len(self.hot)
            self.c.get(self.ns, [key(digest(i)) for i in self.hot[at:at + 4]])
        if self.rounds % 3 == 0:
            self.c.call({"Delete": {"ns": self.ns, "keys": [key(digest(self.next - CHAIN - 3))]}})
        if self.rounds % 5 == 0:  # older than what DRAM holds: on NVMe, or gone
            first = max(0, self.next - DRAM_BLOCKS - 50 * (self.rounds % 40))
            self.c.get(self.ns, [key(digest(i)) for i in range(first, first + 4)])

    def events(self) -> Dict:
        return self.c.stats()["events"]

    def drive(self, batches: int):
        """Traffic until the daemon has published more than `batches` more batches."""
        until = self.events()["batches"] + batches
        while True:
            for _ in range(50):
                self.round()
            if self.events()["batches"] > until:
                return

    def tiers(self) -> Dict[str, int]:
        return {t["tier"]: t["blocks"] for t in self.c.stats()["tiers"]}

    def settle(self):
        """Until the demoter is idle: nothing in flight in either tier and no demotion for 50 ms."""
        t0 = time.monotonic()
        quiet = None
        while True:
            s = self.c.stats()
            dram = next(t for t in s["tiers"] if t["tier"] == "dram")
            if all(t["in_flight"] == 0 for t in s["tiers"]) and s["events"]["queued_bytes"] == 0:
                if quiet and quiet[1] == dram["demotions"]:
                    if time.monotonic() - quiet[0] >= 0.05:
                        return
                else:
                    quiet = (time.monotonic(), dram["demotions"])
            else:
                quiet = None
            assert time.monotonic() - t0 < 20, "demotions still running after 20 s"
            time.sleep(0.005)

    def held(self) -> Set[int]:
        """Router hashes of every block the daemon holds in some tier (its Exists)."""
        t0 = time.monotonic()
        out = {router_hash(i) for i in range(self.next)
               if self.c.exists(self.ns, [key(digest(i))]) == 1}
        print(f"Exists of {self.next} blocks in {time.monotonic() - t0:.1f} s")
        return out


def indexed(ix: Indexer) -> Dict[str, List[int]]:
    """The indexer's blocks of this worker per storage tier, from its /dump."""
    out: Dict[str, List[int]] = {}
    for model, entry in ix.http("/dump").items():
        assert "error" not in entry, (model, entry)
        for ev in entry["events"]:
            if ev["worker_id"] != WORKER:
                continue
            data = ev["event"]["data"]
            assert set(data) == {"stored"}, f"a dump holds stores only: {ev}"
            out.setdefault(ev["storage_tier"], []).extend(b["block_hash"] for b in data["stored"]["blocks"])
    return out


def register(ix: Indexer, d: Daemon):
    ix.http("/register", {"instance_id": WORKER, "endpoint": d.events, "replay_endpoint": d.replay,
                          "model_name": MODEL, "block_size": PAGE})


def in_force(ix: Indexer, node: Node):
    """Puts single root blocks until the indexer holds something: its SUB is connected and a
    live batch reached its listener (which is what makes it ask for the replay)."""
    t0 = time.monotonic()
    while not indexed(ix):
        assert time.monotonic() - t0 < 30, "the indexer learned nothing in 30 s"
        node.put([node.next])
        node.next += 1
        time.sleep(0.05)


def assert_indexer_holds_exactly_the_nodes_blocks(ix: Indexer, node: Node, what: str):
    """Waits (60 s at most) until the indexer's view equals the daemon's blocks, then returns
    the daemon's per-tier counts; fails with the difference otherwise.

    While the view differs, each try publishes one more batch (a new root block): PUB drops
    batches for a subscriber that falls behind (the indexer applies ~600 000 events here), and
    Dynamo's listener notices a loss only from the seq of the next batch it receives, so lost
    batches at the end of the traffic stay unnoticed until more traffic comes. Seen without the
    nudge: the view was exactly the daemon's residency after batch 9907 of 10 024."""
    t0 = time.monotonic()
    nudges = 0
    history = []  # (seconds, indexer per tier, daemon per tier) of every try, for a failure
    while True:
        node.settle()
        counts, view = node.tiers(), indexed(ix)
        per_tier = {t: len(view.get(TIERS[t], [])) for t in TIERS}
        history.append((round(time.monotonic() - t0, 1), per_tier, {t: counts[t] for t in TIERS}))
        union = {h for hs in view.values() for h in hs}
        dupes = sum(len(hs) - len(set(hs)) for hs in view.values())
        # Exists of every block ever put takes seconds: only once the counts agree.
        held = node.held() if per_tier == {t: counts[t] for t in TIERS} else None
        if held is not None and union == held and dupes == 0:
            print(f"{what}: the indexer holds exactly the daemon's {counts['dram']} DRAM and "
                  f"{counts['nvme']} NVMe blocks ({nudges} batches published to nudge it)")
            return counts
        if time.monotonic() - t0 > 60:
            break
        time.sleep(0.3)
        node.put([node.next])
        node.next += 1
        nudges += 1
    # Not converged in 60 s: say how the two views moved and which blocks differ.
    print(f"{what}: (seconds, indexer, daemon) per try: {history}")
    if held is None:
        held = node.held()
    hot = {router_hash(i) for i in node.hot}
    print(f"{what}: held but not indexed: {len(held - union)} ({len((held - union) & hot)} hot); "
          f"indexed but not held: {len(union - held)}; events {node.events()}")
    assert set(view) <= set(TIERS.values()), f"{what}: unexpected tiers {sorted(view)}"
    assert dupes == 0, f"{what}: {dupes} blocks listed twice in one tier"
    assert per_tier == {t: counts[t] for t in TIERS}, \
        f"{what}: indexer per tier {per_tier} != daemon {counts}"
    assert held is not None and union == held, (f"{what}: indexer vs daemon: {len(union - held)} blocks the daemon "
                                                f"does not hold, {len(held - union)} held but not indexed")


def test_the_real_dynamo_indexer_restarted_past_the_ring_ends_with_exactly_the_nodes_blocks(
        tmp_path, ipc_dir):
    # 16 MiB of 4 KiB blocks (4096) over a 32 MiB spill file: puts demote to NVMe, NVMe evicts.
    d = Daemon(tmp_path, ipc_dir, extra=("--dram", "16MiB", "--slab-size", "4MiB",
                                         "--spill-size", "32MiB"))
    indexers = []
    try:
        node = Node(d.connect())
        a = Indexer(tmp_path / "indexer-a.log")
        indexers.append(a)
        register(a, d)
        in_force(a, node)
        node.put_hot(HOT_CHAINS)
        t0 = time.monotonic()
        node.drive(RING)
        print(f"first {RING}+ batches in {time.monotonic() - t0:.1f} s")
        assert_indexer_holds_exactly_the_nodes_blocks(a, node, "following live")

        a.kill()
        before = node.events()
        t0 = time.monotonic()
        node.drive(RING)
        print(f"{RING}+ batches with no indexer in {time.monotonic() - t0:.1f} s")
        node.settle()
        gone = node.events()
        assert gone["batches"] - before["batches"] > RING
        assert gone["replay_ring_evicted"] > before["replay_ring_evicted"] + RING // 2, \
            f"the ring was not overrun: {gone}"
        assert gone["replay_ring_batches"] <= RING, gone
        tiers = {t["tier"]: t for t in node.c.stats()["tiers"]}
        # Blocks whose stores the ring no longer holds: what a restarted router learns only
        # from the snapshot (the churn re-stores everything else within the ring).
        hot_held = sum(node.c.exists(node.ns, [key(digest(i))]) for i in node.hot)
        assert hot_held == len(node.hot), f"{hot_held} of {len(node.hot)} hot blocks held"
        moves = {n: {k: t[k] for k in ("blocks", "evictions", "demotions", "promotions")}
                 for n, t in tiers.items()}
        print(moves)
        # The traffic moved blocks every way the events describe (removals and lower tiers).
        assert (tiers["dram"]["demotions"] > 0 and tiers["nvme"]["evictions"] > 0
                and tiers["dram"]["promotions"] > 0 and tiers["nvme"]["blocks"] > 0), moves

        b = Indexer(tmp_path / "indexer-b.log")
        indexers.append(b)
        register(b, d)
        in_force(b, node)
        for _ in range(30):  # live traffic after the recovery: puts, deletes, promotions
            node.round()
        counts = assert_indexer_holds_exactly_the_nodes_blocks(b, node, "restarted")
        after = node.events()
        assert after["replay_requests"] > gone["replay_requests"], \
            f"the restarted indexer never asked for a replay: {after}"
        assert after["snapshots"] > gone["snapshots"], \
            f"the restarted indexer's replay was not answered with a snapshot: {after}"
        # It carried the residency (thousands of blocks), not a handful: at least half of what
        # the daemon held just before the indexer came back (probes and the background
        # demoter move a few blocks in between).
        carried = after["snapshot_blocks"] - gone["snapshot_blocks"]
        held_then = tiers["dram"]["blocks"] + tiers["nvme"]["blocks"]
        print(f"the snapshot carried {carried} blocks; the daemon held {held_then} before the "
              f"restart and {sum(counts.values())} at the end")
        assert carried >= held_then // 2, (carried, held_then)
    finally:
        for ix in indexers:
            ix.kill()
        d.stop()


def followed_full_node(ix: Indexer, d: Daemon, what: str):
    """`ix` registered with `d` and following it through 6,400 puts (DRAM's 4,096 blocks full,
    the rest demoted, 256 hot blocks kept): (the node, its per-tier counts, which the
    indexer then holds exactly)."""
    node = Node(d.connect())
    register(ix, d)
    in_force(ix, node)
    node.put_hot(HOT_CHAINS)
    for _ in range(800):
        node.round()
    held = assert_indexer_holds_exactly_the_nodes_blocks(ix, node, what)
    assert held["dram"] > 1000 and held["nvme"] > 1000, held
    return node, held


def test_the_real_dynamo_indexer_follows_a_takeover_with_no_storm_and_no_gap(tmp_path, ipc_dir):
    """Issue 42, item 2, in the Dynamo path: an upgrade with `kvnode serve --takeover` while the
    real indexer follows the node. The successor continues the event stream (next seq, the
    blocks adopted as already announced): it publishes nothing for the blocks it took over,
    and the indexer, never restarted nor re-registered, ends with exactly the node's blocks
    after more traffic through the successor (docs/events.md, "Takeover")."""
    d = Daemon(tmp_path, ipc_dir, extra=("--dram", "16MiB", "--slab-size", "4MiB",
                                         "--spill-size", "32MiB"))
    ix = None
    try:
        ix = Indexer(tmp_path / "indexer.log")
        node, held = followed_full_node(ix, d, "before the takeover")

        node.c.close()
        d.takeover()
        node.reconnect(d.connect())
        ev = node.events()
        tiers = node.tiers()
        # Thousands of blocks taken over, not one event for them: no removal/re-store storm.
        assert tiers["dram"] + tiers["nvme"] > 2000, tiers
        assert ev["published"] == 0, f"the successor re-announced what it took over: {ev}"

        for _ in range(100):  # traffic through the successor: puts, deletes, promotions
            node.round()
        assert_indexer_holds_exactly_the_nodes_blocks(ix, node, "after the takeover")
        ev = node.events()
        print(f"successor: {ev['published']} events in {ev['batches']} batches, "
              f"{ev['replay_requests']} replay requests, {ev['snapshots']} snapshots")
    finally:
        if ix is not None:
            ix.kill()
        d.stop()


def test_the_real_dynamo_indexer_follows_a_sigterm_restart_with_moves_only(tmp_path, ipc_dir):
    """Issue 42, item 4, in the Dynamo path: `SIGTERM` and a start on the same spill directory
    while the real indexer follows the node. The new daemon continues the stream: no block is
    announced again on NVMe, each block the old daemon held in DRAM is announced as moved to
    NVMe (the flush copied it down; DRAM is empty after a restart), and the indexer, never
    restarted nor re-registered, holds exactly the node's blocks, without a snapshot
    (docs/events.md, "Restart")."""
    d = Daemon(tmp_path, ipc_dir, extra=("--dram", "16MiB", "--slab-size", "4MiB",
                                         "--spill-size", "64MiB"))
    ix = None
    try:
        ix = Indexer(tmp_path / "indexer.log")
        node, held = followed_full_node(ix, d, "before the restart")

        node.c.close()
        d.restart()
        node.reconnect(d.connect())
        tiers = node.tiers()
        assert tiers["dram"] == 0 and tiers["nvme"] >= held["nvme"], (held, tiers)
        for _ in range(20):
            node.round()
        assert_indexer_holds_exactly_the_nodes_blocks(ix, node, "after the restart")
        ev = node.events()
        print(f"new daemon: {ev['published']} events in {ev['batches']} batches, "
              f"{ev['replay_requests']} replay requests, {ev['snapshots']} snapshots")
        assert ev["snapshots"] == 0, f"the indexer needed a snapshot: the stream did not continue: {ev}"
        # The moves (one NVMe store and one DRAM removal per DRAM block at most) plus the
        # new traffic; a re-announcement of the NVMe tier would add thousands more.
        assert ev["published"] <= 2 * held["dram"] + 20 * 40, ev
    finally:
        if ix is not None:
            ix.kill()
        d.stop()
