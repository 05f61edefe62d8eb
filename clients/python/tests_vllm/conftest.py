"""The kvnode vLLM connector's scheduler side against the real vllm 0.33.0 wheel, on CPU.

vllm is imported at module level on purpose: where it does not import, collection fails and the
run fails (no skip). The venv is built from scripts/locks/vllm.lock; run with
`$(bash scripts/py-venv.sh vllm | tail -1) -m pytest clients/python/tests_vllm` (KVNODE_BIN names the daemon).
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402,F401  (must import: a missing vllm is a failure, not a skip)
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
    set_current_vllm_config)
from vllm.distributed import parallel_state as ps  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from kvnode.wire import wait_for_daemon  # noqa: E402
from kvnode_test_ports import free_port  # noqa: E402,F401  (re-exported to the tests)

ROOT = HERE.parents[2]
EOS = 2
BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 16

assert vllm.__version__.startswith("0.33.0"), f"tests need vllm 0.33.0, found {vllm.__version__}"


def kvnode_bin() -> str:
    b = os.environ.get("KVNODE_BIN") or str(ROOT / "target" / "release" / "kvnode")
    assert Path(b).exists(), f"{b} not built: run `cargo build --release -p kvnode` or set KVNODE_BIN"
    return b


class Daemon:
    """A real kvnode daemon on a private socket."""

    def __init__(self, tmp: Path, extra: tuple = (), env: dict = None):
        tmp.mkdir(parents=True, exist_ok=True)
        self.socket = str(tmp / "kvnode.sock")
        self.log_path = tmp / "daemon.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [kvnode_bin(), "serve", "--socket", self.socket, "--dram", "256MiB", "--slab-size",
             "4MiB", "--no-pin", *extra], stdout=subprocess.DEVNULL, stderr=self.log,
            env={**os.environ, **(env or {})})
        wait_for_daemon(self.socket, self.proc, 10.0, self.log_path)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path / "d")
    yield d
    d.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A local model directory vLLM reads instead of the hub: a tiny Llama config.json."""
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD, "num_hidden_layers": LAYERS, "vocab_size": 512,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
        "bos_token_id": 1, "eos_token_id": EOS}))
    return str(d)


def vllm_config(model_dir: str, socket: str, async_scheduling: bool = False, **extra) -> VllmConfig:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=2048,
                            enable_chunked_prefill=True, is_encoder_decoder=False,
                            async_scheduling=async_scheduling)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.kv_cache_layout = "LBNHC"  # the engine resolves it before building connectors
    ktc = KVTransferConfig(kv_connector="KvnodeConnector", kv_connector_module_path="kvnode.vllm",
                           kv_role=extra.pop("kv_role", "kv_both"),
                           kv_connector_extra_config={"socket": socket, **extra},
                           kv_load_failure_policy="recompute")
    return VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                      kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))


@contextlib.contextmanager
def one_rank(vc: VllmConfig):
    """`vc` current and vLLM's distributed state initialised for one rank (gloo on CPU), as
    vLLM's worker has it before building its connector (`_ranks` reads the real ranks)."""
    with set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(1, 1, backend="gloo")
        try:
            yield vc
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def kv_cache_config(num_blocks: int = 200, groups=None) -> KVCacheConfig:
    """The config vLLM's engine hands the scheduler: layers, block size, no tensors allocated."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * LAYERS, layers=layers,
                                        layer_stride=page * num_blocks, block_stride=page)],
        kv_cache_groups=groups or [KVCacheGroupSpec(layers, spec)])


def make_scheduler(vc: VllmConfig, kcc: KVCacheConfig = None) -> Scheduler:
    kcc = kcc or kv_cache_config()
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    cls = AsyncScheduler if vc.scheduler_config.async_scheduling else Scheduler
    return cls(vllm_config=vc, kv_cache_config=kcc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK)


_hash_ready = False


def make_request(req_id: str, tokens, max_tokens: int = 4, cache_salt=None, kv_transfer_params=None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, extra_args=(
        {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None))
    sp.update_from_generation_config({}, EOS)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=sp,
                   pooling_params=None, mm_features=None, cache_salt=cache_salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def runner_output(reqs, token: int = 7, finished_sending=None, invalid_block_ids=None) -> ModelRunnerOutput:
    """What workers send back after a step (one sampled token per request)."""
    ids = [r.request_id for r in reqs]
    kvo = None
    if finished_sending is not None or invalid_block_ids is not None:
        kvo = KVConnectorOutput(finished_sending=finished_sending, finished_recving=None,
                                invalid_block_ids=invalid_block_ids or set())
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kvo)
