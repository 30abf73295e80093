"""The worker side's KV memory and identity records, without a mesh.

A fake gpuworker client answers ``GET /v1/pool`` and records the
registration; the segment is real (``/dev/shm``), so the tests read what a
gpuworker would map.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh_vllm import config as cfg
from kvmesh_vllm import kvmem
from kvmesh_vllm.errors import ModelMismatchError, UnsupportedLayoutError
from kvmesh_vllm.metadata import BlockWrite, KVMeshConnectorMetadata, PendingLoad
from kvmesh_vllm.model import ModelSpec
from kvmesh_vllm.stats import ConnectorStats
from kvmesh_vllm.worker import WorkerSide, layer_regions

NB = 6
SPEC = {"name": "m", "hash_block_size": 4, "groups": [
    {"kind": "full_attention", "block_size": 4, "bytes_per_block": 2 * 2 * 4 * 8 * 2},  # 2 layers × K/V × 4 tokens × 8 × fp16
    {"kind": "mamba", "block_size": 4, "bytes_per_block": (16 + 48) * 2}]}  # 1 layer: [conv 16, ssm 48] fp16


class FakeWorker:
    """A gpuworker's pool answer, and the registrations posted to it."""

    base_url = "http://fake"

    def __init__(self, model="m", rank=None, groups=None):
        self.pool = {"engine_id": "e1", "model": model, "rank": rank or {"tp": 0, "pcp": 0, "dcp": 0, "pp": 0},
                     "groups": groups or [{"kind": g["kind"], "bytes_per_block": g["bytes_per_block"]} for g in SPEC["groups"]]}
        self.posted = []

    def request(self, method, path, json_body=None, **kw):
        if method == "GET":
            return 200, {}, self.pool
        self.posted.append((path, json_body))
        return 200, {}, {"kind": "shm"}


def side(worker=None):
    settings = cfg.Settings(engine_id="e1", model="m", lookup_url="http://x", kafka={})
    layer_groups = {"attn.0": 0, "attn.1": 0, "mixer.0": 1}
    return WorkerSide(settings, ModelSpec.from_json(SPEC), 0, NB, layer_groups, worker or FakeWorker(), None, ConnectorStats())


def caches():
    return {"attn.0": torch.zeros(2, NB, 4, 1, 8, dtype=torch.float16),
            "attn.1": torch.zeros(2, NB, 4, 1, 8, dtype=torch.float16),
            "mixer.0": [torch.zeros(NB, 16, dtype=torch.float16), torch.zeros(NB, 6, 8, dtype=torch.float16)]}


def test_register_moves_tensors_into_the_segment():
    w, kv = side(), caches()
    w.register_kv_caches(kv)
    try:
        seg = w.segment
        assert [list(g.regions) for g in seg.layout.groups] == [[64, 64, 64, 64], [32, 96]]
        path, body = w._client.posted[0]
        assert path == "/v1/kv-memory" and body["kind"] == "shm" and body["path"] == seg.path
        # the model writes its tensors as before; the bytes land where the gpuworker reads them
        kv["attn.1"][1][3].fill_(1.5)  # V plane of layer 1, block 3
        kv["mixer.0"][1][2].fill_(-2.0)  # ssm state of block 2
        v = seg.block_regions(0, 3)[3].view(np.float16)
        assert (v == 1.5).all() and not seg.block_regions(0, 3)[2].any()
        assert (seg.block_regions(1, 2)[1].view(np.float16) == -2.0).all()
    finally:
        w.shutdown()


def test_forward_records_identities():
    w = side()
    w.register_kv_caches(caches())
    try:
        meta = KVMeshConnectorMetadata(step=7, writes=[BlockWrite("r1", 0, 2, "ab" * 32), BlockWrite("r1", 1, 2, "cd" * 32)])
        w.begin_step(meta)
        seq, held, ok = w.segment.record(0, 2).load()
        assert not ok, "a block being written must not be readable"
        w.wait_for_save()
        for g, h in ((0, "ab" * 32), (1, "cd" * 32)):
            _, held, ok = w.segment.record(g, 2).load()
            assert ok and held.hash == h and held.request_id == "r1"
        assert w.build_connector_worker_meta().steps == {7}
    finally:
        w.shutdown()


@pytest.mark.parametrize("worker, error, words", [
    (FakeWorker(model="other"), ModelMismatchError, "serves model"),
    (FakeWorker(rank={"tp": 1}), UnsupportedLayoutError, "serves rank"),
    (FakeWorker(groups=[{"kind": "full_attention", "bytes_per_block": 1}, {"kind": "mamba", "bytes_per_block": 128}]),
     ModelMismatchError, "group 0: the mesh stores 1 bytes per block"),
])
def test_register_refuses_another_mesh(worker, error, words):
    with pytest.raises(error, match=words):
        side(worker).register_kv_caches(caches())
    assert worker.posted == [], "registered with a gpuworker it does not fit"


def test_shared_cpu_memory_is_refused():
    kv = caches()
    shared = torch.zeros(2, NB, 4, 1, 8, dtype=torch.float16)
    kv["attn.0"] = shared
    kv["mixer.0"] = [shared.reshape(-1)[:NB * 16].view(NB, 16), torch.zeros(NB, 6, 8, dtype=torch.float16)]
    with pytest.raises(UnsupportedLayoutError, match="share memory"):
        side().register_kv_caches(kv)


@pytest.mark.parametrize("tensor, words", [
    (torch.zeros(3, 4), "no block dimension"),
    (torch.zeros(8, NB).t(), "not contiguous"),
])
def test_layer_regions_refuses(tensor, words):
    with pytest.raises(UnsupportedLayoutError, match=words):
        layer_regions("l", tensor, 0, NB)


def test_segment_files_are_removed():
    w = side()
    w.register_kv_caches(caches())
    path = w.segment.path
    w.shutdown()
    with pytest.raises(kvmem.SegmentError):
        kvmem.Segment.open(path)


class FakeFeedback:
    """The feedback topic: the messages the test puts in it."""

    bad_records = 0

    def __init__(self):
        self.values = []

    def drain(self):
        out, self.values = self.values, []
        return out

    def close(self):
        pass


def test_finished_sending_only_for_delayed_frees():
    """kvmesh's finished_sending of a request whose free vLLM did not delay
    (vLLM freed it already) is never reported: vLLM asserts on it."""
    w = side()
    fb = w._feedback = FakeFeedback()
    w.begin_step(KVMeshConnectorMetadata(step=1, delayed_frees=["delayed"]))
    w.wait_for_save()
    for rid in ("delayed", "freed-by-vllm"):
        fb.values.append({"schema": "kvmesh.engine_feedback.v1", "kind": "finished_sending", "engine_id": "e1", "request_id": rid})
    assert w.get_finished({"delayed", "freed-by-vllm"}) == ({"delayed"}, None)
    assert w.get_finished(set()) == (None, None)


def test_feedback_batches_are_applied_in_order():
    """The scheduler's record is a batch of one engine's messages
    (kvmesh.engine_feedback_batch.v1): each is applied, in order; another
    engine's are skipped; a bad message costs only itself, a batch without
    its list only itself, and the records after them are still applied."""
    w = side()
    fb = w._feedback = FakeFeedback()
    w.begin_step(KVMeshConnectorMetadata(step=1, delayed_frees=["a", "b", "c"]))
    w.wait_for_save()

    def msg(rid, engine="e1"):
        return {"schema": "kvmesh.engine_feedback.v1", "kind": "finished_sending", "engine_id": engine, "request_id": rid}

    fb.values.append({"schema": "kvmesh.engine_feedback_batch.v1", "engine_id": "e1",
                      "feedback": [{"schema": "x"}, msg("a"), "junk", msg("b", engine="other")]})
    fb.values.append({"schema": "kvmesh.engine_feedback_batch.v1", "engine_id": "e1"})
    fb.values.append(msg("c"))
    assert w.get_finished({"a", "b", "c"}) == ({"a", "c"}, None)
    assert w._stats.get("bad_feedback") == 3


def _load_error_run(spec_groups):
    """A load of request r1 finished with a load error on block 3."""
    spec = {**SPEC, "groups": spec_groups}
    settings = cfg.Settings(engine_id="e1", model="m", lookup_url="http://x", kafka={})
    w = WorkerSide(settings, ModelSpec.from_json(spec), 0, NB, {}, FakeWorker(), None, ConnectorStats())
    fb = w._feedback = FakeFeedback()
    w.begin_step(KVMeshConnectorMetadata(step=1, loads=[PendingLoad("r1", ((0, 2), (0, 3)))]))
    w.wait_for_save()
    fb.values.append({"schema": "kvmesh.engine_feedback.v1", "kind": "finished_recving", "engine_id": "e1",
                      "request_id": "r1", "load_errors": [3]})
    assert w.get_finished(set()) == (None, {"r1"})
    return w


def test_load_errors_of_a_one_group_model_are_blocks():
    """One group: vLLM's invalid_block_ids (its kv_load_failure_policy)."""
    w = _load_error_run(SPEC["groups"][:1])
    assert w.get_block_ids_with_load_errors() == {3}
    meta = w.build_connector_worker_meta()
    assert meta is None or meta.failed_loads == set()


def test_load_errors_of_a_hybrid_model_name_the_request():
    """Several groups: never invalid_block_ids (vLLM's one-group path
    raises on them); the request, in the worker metadata of the same step."""
    w = _load_error_run(SPEC["groups"])
    assert w.get_block_ids_with_load_errors() == set()
    assert w.build_connector_worker_meta().failed_loads == {"r1"}
    assert w.build_connector_worker_meta() is None  # reported once


def _load_error_feedback(w, rid="r1", errors=(3,)):
    """Starts a load of rid and queues its finished_recving with errors."""
    fb = w._feedback = FakeFeedback()
    w.begin_step(KVMeshConnectorMetadata(step=1, loads=[PendingLoad(rid, ((0, 2), (0, 3)))]))
    w.wait_for_save()
    fb.values.append({"schema": "kvmesh.engine_feedback.v1", "kind": "finished_recving", "engine_id": "e1",
                      "request_id": rid, "load_errors": list(errors)})


@pytest.mark.parametrize("groups, failed, blocks", [
    (SPEC["groups"][:1], set(), {3}),   # one group: vLLM's invalid_block_ids
    (SPEC["groups"], {"r1"}, set()),   # hybrid: failed_recving, never block ids
])
def test_transfer_results_report_failed_loads_once(groups, failed, blocks):
    """Newer vLLM's get_transfer_results: a hybrid model's failed load is
    failed_recving (also in finished_recving), and then not again in the
    worker metadata; a one-group model's stays block-level."""
    settings = cfg.Settings(engine_id="e1", model="m", lookup_url="http://x", kafka={})
    w = WorkerSide(settings, ModelSpec.from_json({**SPEC, "groups": groups}), 0, NB, {}, FakeWorker(), None, ConnectorStats())
    _load_error_feedback(w)
    sending, recving, got = w.transfer_results(set())
    assert (sending, recving, got) == (set(), {"r1"}, failed)
    assert w.get_block_ids_with_load_errors() == blocks
    meta = w.build_connector_worker_meta()
    assert meta is None or meta.failed_loads == set()
    assert w.transfer_results(set()) == (set(), set(), set())


def test_connector_get_transfer_results():
    """The connector's get_transfer_results builds vLLM's
    KVConnectorTransferResults (or the stand-in) from the worker side."""
    from kvmesh_vllm._vllm import KVConnectorTransferResults
    from kvmesh_vllm.connector import KVMeshConnector

    conn = KVMeshConnector.__new__(KVMeshConnector)
    conn._worker, conn._scheduler = side(), None
    _load_error_feedback(conn._worker)
    res = conn.get_transfer_results(set())
    assert isinstance(res, KVConnectorTransferResults)
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), {"r1"}, {"r1"})


def test_a_step_begins_once():
    """vLLM hands the same metadata to handle_preemptions and then to
    bind_connector_metadata: the step's blocks are opened once (the second
    call would find them busy), and recorded after the pass."""
    from kvmesh_vllm.connector import KVMeshConnector

    conn = KVMeshConnector.__new__(KVMeshConnector)
    conn._connector_metadata, conn._scheduler = None, None
    conn._worker = w = side()
    w.register_kv_caches(caches())
    try:
        meta = KVMeshConnectorMetadata(step=3, writes=[BlockWrite("r1", 0, 1, "ab" * 32)])
        conn.handle_preemptions(meta)
        assert not w.segment.record(0, 1).load()[2], "handle_preemptions must open the step's blocks"
        conn.bind_connector_metadata(meta)
        conn.wait_for_save()
        _, held, ok = w.segment.record(0, 1).load()
        assert ok and held.hash == "ab" * 32
        assert w._stats.get("blocks_busy") == 0 and w._stats.get("blocks_recorded") == 1
        nxt = KVMeshConnectorMetadata(step=4, writes=[BlockWrite("r2", 0, 1, "cd" * 32)])
        conn.bind_connector_metadata(nxt)  # a new step (no handle_preemptions): begun at bind
        assert not w.segment.record(0, 1).load()[2]
        conn.wait_for_save()
        assert w.segment.record(0, 1).load()[1].hash == "cd" * 32
    finally:
        w.shutdown()
