"""KvnodeConnector built in vLLM's worker role, as vLLM's worker builds it: after its distributed
state is initialised (one rank, gloo on CPU), so `_ranks` reads the real tensor, pipeline and
decode-context ranks from vllm.distributed.parallel_state.

What it checks: the worker-role connector derives exactly the namespace of the scheduler-role
one (a difference would make every worker save into a namespace the scheduler never looks up),
the daemon gives both the same namespace id, and the worker-role methods that do not touch the
GPU (finished, load errors, preemption drain, shutdown) behave on an idle connector. The GPU
moves themselves (register_kv_caches, start_load_kv, wait_for_layer_load, wait_for_save) run
against the daemon's fake GPU in test_worker_moves.py, and on a real GPU in gpu_worker.py.
"""

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from conftest import kv_cache_config, one_rank as one_rank_of, vllm_config
from kvnode.vllm import KvnodeConnector
from kvnode.vllm.connector import KvnodeConnectorMetadata
from kvnode.vllm.plan import StepPlan
from kvnode.wire import Connection


@pytest.fixture
def one_rank(model_dir, daemon):
    with one_rank_of(vllm_config(model_dir, daemon.socket)) as vc:
        yield vc


def test_worker_and_scheduler_roles_derive_the_same_namespace(one_rank, daemon):
    vc = one_rank
    kcc = kv_cache_config()
    sched = KvnodeConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    worker = KvnodeConnector(vc, KVConnectorRole.WORKER, kcc)
    try:
        assert worker.worker is not None and worker.sched is None
        assert sched.sched is not None and sched.worker is None
        assert worker.geometry == sched.geometry
        assert worker.spec == sched.spec
        # The daemon agrees: the two specs name one namespace.
        a, b = Connection(daemon.socket), Connection(daemon.socket)
        try:
            assert a.register(sched.spec)["ns"] == b.register(worker.spec)["ns"]
        finally:
            a.close()
            b.close()
    finally:
        sched.shutdown()
        worker.shutdown()


def test_worker_role_methods_on_an_idle_connector(one_rank):
    vc = one_rank
    worker = KvnodeConnector(vc, KVConnectorRole.WORKER, kv_cache_config())
    try:
        # A finished request that never offloaded is not reported (vLLM freed its blocks).
        assert worker.get_finished({"r-1"}) == (None, None)
        assert worker.get_block_ids_with_load_errors() == set()
        # A step without loads or saves: the preemption drain returns at once.
        worker.handle_preemptions(KvnodeConnectorMetadata(StepPlan()))
        assert worker.get_kv_connector_stats() is None
    finally:
        worker.shutdown()
