"""`kvnode.common.NamespaceSpec` mirrors the daemon's NamespaceSpec, and the three integrations'
namespaces did not move when they started building it.

- the dataclass has every field of engine/proto/src/namespace.rs, in order, with the matching
  type (parsed from the Rust source), and MAX_SEGMENTS is the Rust constant;
- every field reaches a real daemon: changing any one changes the namespace id it derives
  (the daemon ignores a map key it does not know, so a misspelled field would be lost silently);
- SGLang's, the vLLM connector's and the vLLM tier's specs for fixed inputs equal the maps those
  integrations registered before (a changed map is a new namespace id: every cached page of a
  deployment would miss after an upgrade).

Run: `KVNODE_BIN=target/release/kvnode python -m pytest clients/python/tests/test_namespace_spec.py`.
"""

import dataclasses
import pathlib
import re
import typing
from types import SimpleNamespace as NS

import pytest

from kvnode.common import MAX_SEGMENTS, NamespaceSpec
from kvnode.wire import Connection

NAMESPACE_RS = pathlib.Path(__file__).resolve().parents[3] / "engine" / "proto" / "src" / "namespace.rs"
#: Rust field type -> the Python annotation that mirrors it.
RUST_TO_PY = {
    "String": "str",
    "u32": "int",
    "bool": "bool",
    "Vec<u64>": "Tuple[int, ...]",
    "Option<(u32, u32)>": "Optional[Tuple[int, int]]",
}


def rust_fields():
    text = NAMESPACE_RS.read_text()
    body = text[text.index("pub struct NamespaceSpec {"):]
    body = body[: body.index("\n}")]
    fields = re.findall(r"^\s{4}pub (\w+): ([^\n]+),$", body, re.M)
    assert len(fields) >= 10, f"parsed only {fields} from namespace.rs"
    return fields


def test_namespace_spec_has_every_rust_field_in_order_with_its_type():
    py = [(f.name, f.type) for f in dataclasses.fields(NamespaceSpec)]
    want = [(name, RUST_TO_PY.get(ty, f"<no mirror for Rust type {ty}>")) for name, ty in rust_fields()]
    assert py == want


def test_max_segments_is_the_daemon_limit():
    m = re.search(r"pub const MAX_SEGMENTS: usize = (\d+);", NAMESPACE_RS.read_text())
    assert m and int(m.group(1)) == MAX_SEGMENTS


def test_to_wire_is_one_plain_map_entry_per_field():
    spec = NamespaceSpec(model="m", page_size=4, kv_shape=(1, 2), head_range=(0, 4), segments=(8,))
    wire = spec.to_wire()
    assert list(wire) == [f.name for f in dataclasses.fields(NamespaceSpec)]
    assert wire["kv_shape"] == [1, 2] and wire["head_range"] == [0, 4] and wire["segments"] == [8]
    assert wire["layer_range"] is None and wire["tp_size"] == 0


#: A registrable spec: the fields not given keep their defaults (head_range, layer_range: None).
BASE = NamespaceSpec(model="m", dtype="bf16", page_size=16, layout="page_first", kv_shape=(2, 4),
                     tp_rank=0, tp_size=2, pp_rank=0, pp_size=2, cp_rank=0, cp_size=2,
                     mla=False, tenant_salt="", segments=(4096,))
#: One change per field, each registrable (ranks stay below their sizes).
CHANGED = {
    "model": "m2", "dtype": "fp8", "page_size": 32, "layout": "layer_first", "kv_shape": (2, 5),
    "tp_rank": 1, "tp_size": 4, "pp_rank": 1, "pp_size": 4, "cp_rank": 1, "cp_size": 4,
    "head_range": (0, 4), "layer_range": (0, 2), "mla": True, "tenant_salt": "t",
    "segments": (4096, 4096),
}


def test_every_field_changes_the_namespace_id_the_daemon_derives(daemon):
    assert set(CHANGED) == {f.name for f in dataclasses.fields(NamespaceSpec)}
    c = Connection(daemon.socket)
    try:
        base = c.register(BASE)["id"]
        assert c.register(BASE.to_wire())["id"] == base, "a spec and its wire map are one namespace"
        same = [name for name, value in CHANGED.items()
                if c.register(dataclasses.replace(BASE, **{name: value}))["id"] == base]
        assert same == [], f"fields the daemon did not fold into the id: {same}"
        # Why the names must match: a key the daemon does not know is dropped without a word.
        assert c.register({**BASE.to_wire(), "modle": "other"})["id"] == base
    finally:
        c.close()


def sglang_inputs(mla=False):
    config = NS(model_name="Qwen/Qwen3-8B", tp_size=2, tp_rank=1, pp_rank=0, pp_size=1,
                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla, tp_lcm_size=4,
                should_split_heads=True, dcp_rank=0, dcp_size=1,
                extra_config={"tenant_salt": "team-a"})
    pool = NS(head_num=4, layout="page_first", layer_num=36, head_dim=128, dtype="torch.bfloat16",
              page_size=64, start_layer=0, kv_lora_rank=0, qk_rope_head_dim=0)
    return config, pool


def tier_inputs():
    group = NS(group_id=0, tokens_per_block=16, sliding_window_size_in_chunks=None,
               layer_names=["model.layers.0.self_attn.attn"])
    par = NS(is_parallelism_agnostic=False, pcp_size=1, dcp_size=1, world_size=2, tp_size=2,
             pp_size=1)
    return NS(groups=[group], parallel=par, kv_cache_layout="NHD", canonical_layout=False,
              replicated_layout=False, model=NS(name="Qwen/Qwen3-8B", dtype="torch.float16"),
              cache=NS(tokens_per_hash=16, blocks_per_chunk=4), worker_kv_bytes_per_block=8192)


def built(case):
    """The wire map each integration builds for fixed inputs (no engine is imported)."""
    from kvnode.namespace import namespace_spec
    from kvnode.vllm.keys import RankGeometry, Segment
    from kvnode.vllm_tier import namespace as tier_ns

    if case == "vllm_connector":
        return RankGeometry(model="Qwen/Qwen3-8B", dtype="auto:bfloat16", block_size=16,
                            layout="NHD", hash_algo="sha256", num_kv_heads=8, head_size=128,
                            num_layers=36, segments=(Segment(36, 4096),), tp_rank=1, tp_size=2,
                            tenant_salt="team-a").namespace_spec()
    if case == "vllm_tier":
        return tier_ns.namespace_spec(tier_inputs(), 32768, b"seed", "", "team-a")
    config, pool = sglang_inputs(mla=case in ("sglang_mla", "sglang_mamba"))
    if case == "sglang_kv":
        return namespace_spec(config, pool, [8192, 8192])
    if case == "sglang_mla":
        return namespace_spec(config, pool, [16384])
    if case == "sglang_mamba":
        return namespace_spec(config, pool, [512, 256], pool="mamba", replicated=False)
    return namespace_spec(config, pool, [16384], flavor="flat")


def _wire(**over):
    base = {"model": "Qwen/Qwen3-8B", "dtype": "torch.bfloat16", "page_size": 64,
            "layout": "page_first", "kv_shape": [36, 4, 128, 0, 0, 4, 1, 0, 1, 0], "tp_rank": 1,
            "tp_size": 2, "pp_rank": 0, "pp_size": 1, "cp_rank": 0, "cp_size": 1,
            "head_range": [4, 8], "layer_range": None, "mla": False, "tenant_salt": "team-a",
            "segments": [8192, 8192]}
    return {**base, **over}


#: What each integration registered before NamespaceSpec existed (captured from that code).
BEFORE = {
    "sglang_kv": _wire(),
    "sglang_mla": _wire(head_range=None, mla=True, segments=[16384]),
    "sglang_mamba": _wire(layout="page_first+pool=mamba", segments=[512, 256]),
    "sglang_flat": _wire(layout="page_first+flat", segments=[16384]),
    "vllm_connector": _wire(dtype="auto:bfloat16", page_size=16, layout="vllm:NHD:sha256",
                            kv_shape=[36, 8, 128, 0, 1, 36, 4096], head_range=None,
                            segments=[147456]),
    "vllm_tier": _wire(dtype="torch.float16", layout="vllm-tier:NHD:23352e501e56ea4772fe913e90de1fde"
                       ":seed=c7983ee6f33b8924f8af70f90f86d38c", kv_shape=[16, 4, 8192, 32768, 1],
                       tp_rank=0, head_range=None, segments=[32768]),
}


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_each_integration_registers_the_namespace_it_registered_before(case):
    assert built(case) == BEFORE[case]
