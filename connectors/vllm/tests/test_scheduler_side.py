"""The scheduler side's records, step by step, without a mesh.

A fake lookup client answers as kvmesh's lookup does and the published
records are kept in a list, so each test reads exactly what the connector
would put on ``kvmesh.engine.steps``; the scenarios are those of
``docs/contract.md`` and the seed's MultiConnector path.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "mesh"))

import fakevllm as fv  # noqa: E402
from fixtures_transport import Answer, ScriptedServer, http_server  # noqa: E402,F401 - the fixture is used by name
from kvmesh_vllm import config as cfg  # noqa: E402
from kvmesh_vllm import transport  # noqa: E402
from kvmesh_vllm.model import ModelSpec  # noqa: E402
from kvmesh_vllm.scheduler import SchedulerSide  # noqa: E402
from kvmesh_vllm.stats import ConnectorStats  # noqa: E402

SPEC = {"name": "hybrid", "hash_block_size": 16, "groups": [
    {"kind": "mla", "block_size": 16, "bytes_per_block": 64},
    {"kind": "mamba", "block_size": 16, "bytes_per_block": 128}]}


class FakeLookup:
    """Answers every lookup with the store child's hit (or "not yet")."""

    def __init__(self, hit: int = 0, pending: int = 0, fail: bool = False) -> None:
        self.hit, self.pending, self.fail = hit, pending, fail
        self.calls: list[dict] = []

    def request(self, method, path, json_body=None, **kw):
        self.calls.append(json_body)
        if self.fail:
            raise OSError("connection refused")
        if self.pending > 0:
            self.pending -= 1
            return 200, {}, {"decision_id": "d0", "pending": True, "external_tokens": 0, "children": []}
        n = json_body["num_computed_tokens"]
        ext = max(0, self.hit - n)
        return 200, {}, {
            "decision_id": f"d{len(self.calls)}", "chosen": "store" if ext else "", "external_tokens": ext, "load_async": True,
            "children": [{"name": "pd", "tokens": 0}, {"name": "store", "tokens": ext,
                         "load_spec": {"vllm_cached_tokens": n, "kvpool_cached_tokens": self.hit, "can_load": False}}]}


class Side:
    """A SchedulerSide with its fakes, and what it published."""

    def __init__(self, lookup: FakeLookup, fail_publish: bool = False) -> None:
        self.records: list[dict] = []
        self.lookup = lookup
        self.stats = ConnectorStats()
        self.fail_publish = fail_publish
        settings = cfg.Settings(engine_id="e1", model="hybrid", lookup_url="http://x", kafka={})
        self.s = SchedulerSide(settings, ModelSpec.from_json(SPEC), lookup, self._publish, self.stats)

    def _publish(self, value: bytes, done) -> None:
        if self.fail_publish:
            done(RuntimeError("broker down"))
            return
        self.records.append(json.loads(value))
        done(None)

    def events(self) -> list[dict]:
        return [e for r in self.records for e in r["requests"]]

    def ask(self, req, computed=0, deadline=5.0):
        """Calls get_num_new_matched_tokens until it answers, as vLLM's loop does."""
        end = time.monotonic() + deadline
        while True:
            n, async_ = self.s.get_num_new_matched_tokens(req, computed)
            if n is not None:
                return n, async_
            assert time.monotonic() < end, "lookup never answered"
            time.sleep(0.002)  # poll interval of a deadline-bounded wait


def request(rid="r1", tokens=40, trace_headers=None):
    req = fv.Request(rid, list(range(1, tokens + 1)), 4, 16, b"salt")
    if trace_headers is not None:
        req.trace_headers = trace_headers  # vLLM's Request.trace_headers
    return req


def new_step(req, table, n):
    return fv.SchedulerOutput(scheduled_new_reqs=[fv.NewRequestData(req.request_id, req.prompt_token_ids, table, 0)],
                              num_scheduled_tokens={req.request_id: n}, total_num_scheduled_tokens=n)


def test_lookup_not_yet_then_answer():
    side = Side(FakeLookup(hit=32, pending=1))
    req = request(tokens=40)
    assert side.s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert side.ask(req) == (32, True)
    assert side.stats.get("lookup_pending") == 1
    body = side.lookup.calls[-1]
    assert body["num_tokens"] == 40 and len(body["block_hashes"]) == 2 and body["engine_id"] == "e1"


def test_lookup_failure_answers_zero():
    side = Side(FakeLookup(fail=True))
    assert side.ask(request()) == (0, False)
    assert side.stats.get("lookup_failures") == 1


def test_reset_lookups_asks_again():
    """reset_cache (vLLM's reset_prefix_cache with reset_connector): a
    request not allocated yet is looked up again; the new answer counts."""
    side = Side(FakeLookup(hit=32))
    req = request(tokens=40)
    assert side.ask(req) == (32, True)
    side.lookup.hit = 16
    side.s.reset_lookups()
    assert side.ask(req) == (16, True)
    assert len(side.lookup.calls) == 2


def test_no_lookup_where_vllm_takes_no_tokens():
    """loads=False (vLLM 2026-05-27 with Mamba layers): answered 0 at
    once, never looked up, counted once per request."""
    settings = cfg.Settings(engine_id="e1", model="hybrid", lookup_url="http://x", kafka={})
    lookup, stats = FakeLookup(hit=32), ConnectorStats()
    s = SchedulerSide(settings, ModelSpec.from_json(SPEC), lookup, lambda v, done: done(None), stats, loads=False)
    req = request(tokens=40)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert lookup.calls == [] and stats.get("lookups_skipped") == 1


def test_record_waits_for_the_steps_output():
    side = Side(FakeLookup(hit=0))
    req = request(tokens=40)
    assert side.ask(req) == (0, False)
    table = ([1, 2, 3], [4, 5, 6])
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(table), 0)
    meta = side.s.build_connector_meta(new_step(req, table, 40))
    assert side.records == [], "published before the step's KV was computed"
    # every block the step writes; the complete ones with their chunk's hash
    assert [(w.group, w.block, bool(w.hash_hex)) for w in meta.writes] == [
        (0, 1, True), (0, 2, True), (0, 3, False), (1, 4, True), (1, 5, True), (1, 6, False)]
    side.s.update_connector_output(fv.KVConnectorOutput())
    evs = side.events()
    assert [(e["kind"], e["seq"]) for e in evs] == [("admitted", 1), ("allocated", 2), ("scheduled", 3)]
    step = evs[2]["step"]
    assert step["kind"] == "new" and step["tokens"] == 40 and step["block_table"] == [[1, 2, 3], [4, 5, 6]]
    assert step["prefill_tokens"] == 40 and len(step["block_hashes"]) == 2
    assert side.records[0]["null_block_id"] == 0 and side.records[0]["engine_id"] == "e1"


def test_pd_child_wins_nothing_to_load_or_save():
    """The seed's path: kvmesh hit, MultiConnector chose another child,
    kvmesh told 0 — the allocation carries 0 tokens and the decision, no
    pending load, and kvmesh records the other child's blocks' identities
    at the first scheduled step."""
    side = Side(FakeLookup(hit=32))
    req = request(tokens=40)
    assert side.ask(req) == (32, True)
    table = ([1, 2, 3], [0, 5, 6])
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(table), 0)
    so = fv.SchedulerOutput(scheduled_new_reqs=[fv.NewRequestData("r1", req.prompt_token_ids, table, 32)],
                            num_scheduled_tokens={"r1": 8}, total_num_scheduled_tokens=8)
    meta = side.s.build_connector_meta(so)
    side.s.update_connector_output(fv.KVConnectorOutput())
    kinds = [e["kind"] for e in side.events()]
    assert kinds == ["admitted", "allocated", "scheduled"]
    alloc = side.events()[1]
    assert "external_tokens" not in alloc and alloc["decision_id"]
    assert side.events()[2]["step"]["kind"] == "new"
    assert meta.loads == []
    assert sorted((w.group, w.block, w.adopt, bool(w.hash_hex)) for w in meta.writes) == [
        (0, 1, True, True), (0, 2, True, True), (0, 3, False, False), (1, 5, True, True), (1, 6, False, False)]
    assert side.stats.get("lookups_not_chosen") == 1 and side.stats.get("foreign_tokens") == 32


def test_load_then_resume():
    side = Side(FakeLookup(hit=32))
    req = request(tokens=40)
    assert side.ask(req) == (32, True)
    table = ([1, 2], [0, 5])
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(table), 32)
    meta = side.s.build_connector_meta(fv.SchedulerOutput())
    assert [(l.request_id, l.blocks) for l in meta.loads] == [("r1", ((0, 1), (0, 2), (1, 5)))]
    assert side.records == [], "a load's record must wait until the workers noted the load"
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert [e["kind"] for e in side.events()] == ["admitted", "allocated", "scheduled"]
    assert side.events()[2]["step"]["kind"] == "pending_load" and side.events()[1]["external_tokens"] == 32
    side.s.update_connector_output(fv.KVConnectorOutput(finished_recving={"r1"}))
    assert side.s.get_num_new_matched_tokens(req, 32) == (0, False)
    full = ([1, 2, 3], [0, 5, 6])
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(full), 0)
    so = fv.SchedulerOutput(scheduled_new_reqs=[fv.NewRequestData("r1", req.prompt_token_ids, full, 32)],
                            num_scheduled_tokens={"r1": 8}, total_num_scheduled_tokens=8)
    meta = side.s.build_connector_meta(so)
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert [e["kind"] for e in side.events()] == ["admitted", "allocated", "scheduled", "scheduled"]
    assert side.events()[3]["step"]["block_table"] == [[1, 2, 3], [0, 5, 6]]
    assert [(w.group, w.block, w.hash_hex) for w in meta.writes] == [(0, 3, ""), (1, 6, "")], \
        "a 40-token request completes no block beyond the load's; its partial blocks record nothing"


def test_preempt_resume_finish_in_order():
    side = Side(FakeLookup(hit=0))
    req = request(tokens=32)
    side.ask(req)
    table = ([1, 2], [3, 4])
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(table), 0)
    side.s.build_connector_meta(new_step(req, table, 32))
    side.s.update_connector_output(fv.KVConnectorOutput())
    side.s.build_connector_meta(fv.SchedulerOutput(preempted_req_ids={"r1"}))
    assert side.ask(req) == (0, False)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([7, 8], [9, 10])), 0)
    cr = fv.CachedRequestData(req_ids=["r1"], resumed_req_ids={"r1"}, new_block_ids=[([7, 8], [9, 10])], num_computed_tokens=[0])
    side.s.build_connector_meta(fv.SchedulerOutput(scheduled_cached_reqs=cr, num_scheduled_tokens={"r1": 32}, total_num_scheduled_tokens=32))
    delay, _ = side.s.request_finished(req, [[7, 8], [9, 10]])
    assert delay is True
    assert [e["kind"] for e in side.events()][-1] != "finished", "the finish overtook its step's record"
    side.s.update_connector_output(fv.KVConnectorOutput())
    evs = side.events()
    assert [e["seq"] for e in evs] == list(range(1, len(evs) + 1))
    assert [e["kind"] for e in evs] == ["admitted", "allocated", "scheduled", "preempted", "allocated", "scheduled", "finished"]
    assert evs[5]["step"]["kind"] == "resumed" and evs[5]["step"]["block_table"] == [[7, 8], [9, 10]]


def test_publish_failure_is_counted_not_raised():
    side = Side(FakeLookup(hit=0), fail_publish=True)
    req = request(tokens=16)
    side.ask(req)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1], [2])), 0)
    side.s.build_connector_meta(new_step(req, ([1], [2]), 16))
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert side.stats.get("publish_failures") == 1


def test_decode_without_new_blocks_publishes_nothing():
    side = Side(FakeLookup(hit=0))
    req = request(tokens=16)
    side.ask(req)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1, 2], [3, 4])), 0)
    side.s.build_connector_meta(new_step(req, ([1, 2], [3, 4]), 16))
    side.s.update_connector_output(fv.KVConnectorOutput())
    req.append_output(99)
    n = len(side.records)
    cr = fv.CachedRequestData(req_ids=["r1"], new_block_ids=[None], num_computed_tokens=[16])
    side.s.build_connector_meta(fv.SchedulerOutput(scheduled_cached_reqs=cr, num_scheduled_tokens={"r1": 1}, total_num_scheduled_tokens=1))
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert len(side.records) == n


@pytest.mark.parametrize("extra, words", [
    ({}, "engine_id"),
    ({"kvmesh.engine_id": "e"}, "kvmesh.model"),
    ({"kvmesh.engine_id": "e", "kvmesh.model": "m"}, "lookup_url"),
    ({"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l", "kvmesh.bogus": 1}, "unknown settings"),
    ({"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l", "kvmesh.token": "a", "kvmesh.token_file": "/x"}, "not both"),
    ({"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l", "kvmesh.load_timeout_s": -1}, "positive"),
])
def test_settings_errors_name_the_setting(extra, words):
    with pytest.raises(cfg.KVMeshConfigError, match=words):
        cfg.load(extra, env={"KVMESH_KAFKA_BROKERS": "127.0.0.1:9092"})


def test_shared_groups_finds_groups_sharing_memory():
    """vLLM's hybrid allocator may back layers of two groups with one
    buffer: their identity records must be cleared together."""
    import torch

    from kvmesh_vllm.worker import shared_groups

    buf = torch.zeros(4, 64)
    alone = torch.zeros(4, 64)
    layers = [[(buf[:, :32], None)], [(buf[:, 16:], None)], [(alone, None)]]
    assert shared_groups(layers) == {0: {1}, 1: {0}}
    assert shared_groups([[(alone, None)], [(torch.zeros(4, 64), None)]]) == {}


def test_free_delayed_only_where_kvmesh_may_save():
    """request_finished delays the free of a request that ran, and names it
    to the workers; a request whose load is in flight (vLLM frees it at its
    finished_recving) or that never ran is freed at once."""
    side = Side(FakeLookup(hit=32))
    ran, loading, idle = request("ran", 40), request("loading", 40), request("idle", 40)
    for r in (ran, loading, idle):
        side.ask(r)
    side.s.update_state_after_alloc(ran, fv.KVCacheBlocks(([1, 2, 3], [0, 5, 6])), 0)
    side.s.update_state_after_alloc(loading, fv.KVCacheBlocks(([7, 8], [0, 9])), 32)
    side.s.update_state_after_alloc(idle, fv.KVCacheBlocks(([10, 11, 12], [0, 13, 14])), 0)
    side.s.build_connector_meta(fv.SchedulerOutput(
        scheduled_new_reqs=[fv.NewRequestData("ran", ran.prompt_token_ids, ([1, 2, 3], [0, 5, 6]), 32)],
        num_scheduled_tokens={"ran": 8}, total_num_scheduled_tokens=8))
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert side.s.request_finished(ran, [[1, 2, 3], [0, 5, 6]]) == (True, None)
    assert side.s.request_finished(loading, [[7, 8], [0, 9]]) == (False, None)
    assert side.s.request_finished(idle, [[10, 11, 12], [0, 13, 14]]) == (False, None)
    meta = side.s.build_connector_meta(fv.SchedulerOutput(finished_req_ids={"ran", "loading", "idle"}))
    assert meta.delayed_frees == ["ran"]
    finished = [e["request_id"] for e in side.events() if e["kind"] == "finished"]
    assert sorted(finished) == ["idle", "loading", "ran"], "every finish is published"


def test_allocation_after_running_is_a_preemption():
    """A running request allocated again without preempted_req_ids naming
    it (vLLM's reset_prefix_cache with running requests) gets its preempted
    event first, so the mesh resets its tracker instead of refusing a
    second allocation."""
    side = Side(FakeLookup(hit=0))
    req = request(tokens=32)
    side.ask(req)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1, 2], [3, 4])), 0)
    side.s.build_connector_meta(new_step(req, ([1, 2], [3, 4]), 32))
    side.s.update_connector_output(fv.KVConnectorOutput())
    req.num_computed_tokens = 0
    side.ask(req)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([5, 6], [7, 8])), 0)
    side.s.build_connector_meta(fv.SchedulerOutput())
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert [e["kind"] for e in side.events()] == ["admitted", "allocated", "scheduled", "preempted", "allocated"]


def test_resumed_prefill_chunks_are_not_decode():
    """After a resume every token is prefilled again: a later chunk past
    the prompt is a running step (saved), not a decode step."""
    side = Side(FakeLookup(hit=0))
    req = request(tokens=32)
    for t in range(20):
        req.append_output(100 + t)  # 52 tokens now, 32 of them prompt
    side.ask(req)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1, 2], [3, 4])), 0)
    side.s._reqs["r1"].scheduled = True  # it ran before its preemption
    cr = fv.CachedRequestData(req_ids=["r1"], resumed_req_ids={"r1"}, new_block_ids=[([1, 2], [3, 4])], num_computed_tokens=[0])
    side.s.build_connector_meta(fv.SchedulerOutput(scheduled_cached_reqs=cr, num_scheduled_tokens={"r1": 32}, total_num_scheduled_tokens=32))
    side.s.update_connector_output(fv.KVConnectorOutput())
    cr = fv.CachedRequestData(req_ids=["r1"], new_block_ids=[([9, 10], [11, 12])], num_computed_tokens=[32])
    side.s.build_connector_meta(fv.SchedulerOutput(scheduled_cached_reqs=cr, num_scheduled_tokens={"r1": 20}, total_num_scheduled_tokens=20))
    side.s.update_connector_output(fv.KVConnectorOutput())
    steps = [e["step"] for e in side.events() if e["kind"] == "scheduled"]
    assert [s["kind"] for s in steps] == ["resumed", "running"]
    assert steps[0]["prefill_tokens"] == 52


def test_failed_recving_recomputes_from_scratch():
    """Newer vLLM (failed_recving): vLLM itself applies its policy — under
    "recompute" it frees the request's blocks and schedules it from 0. The
    scheduler side counts the failure, leaves num_computed_tokens to vLLM,
    answers the new ask 0 without a lookup (no retry loop on a failed
    load), and the first step records the new table."""
    side = Side(FakeLookup(hit=32))
    req = request(tokens=40)
    assert side.ask(req) == (32, True)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1, 2], [0, 5])), 32)
    side.s.build_connector_meta(fv.SchedulerOutput())
    side.s.update_connector_output(fv.KVConnectorOutput())
    req.num_computed_tokens = 0  # vLLM's _handle_failed_recving under "recompute"
    side.s.update_connector_output(fv.KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"}))
    assert side.stats.get("load_failures_reported") == 1 and side.stats.get("load_recomputes") == 0
    assert req.num_computed_tokens == 0
    calls = len(side.lookup.calls)
    assert side.s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(side.lookup.calls) == calls, "a request whose load failed was looked up again"
    table = ([7, 8, 9], [0, 10, 11])  # vLLM freed the old blocks and allocated anew
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(table), 0)
    meta = side.s.build_connector_meta(new_step(req, table, 40))
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert [e["kind"] for e in side.events()] == ["admitted", "allocated", "scheduled", "scheduled"]
    step = side.events()[3]["step"]
    assert step["kind"] == "new" and step["tokens"] == 40 and step["block_table"] == [[7, 8, 9], [0, 10, 11]]
    assert [(w.group, w.block, bool(w.hash_hex)) for w in meta.writes] == [
        (0, 7, True), (0, 8, True), (0, 9, False), (1, 10, True), (1, 11, False)]


# ---- trace context (vLLM's Request.trace_headers) ----------------------

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TP2 = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
#: trace_headers that must carry nothing into the mesh.
UNTRACED = [None, {}, {"tracestate": "congo=t61rcWkgMzE"},
            {"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"},
            {"traceparent": "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01"},
            {"traceparent": "not a traceparent", "tracestate": "congo=t61rcWkgMzE"}]


def http_side(server: ScriptedServer) -> Side:
    """A Side whose lookups go over HTTP, through the connector's client,
    to a scripted lookup answering "no hit"."""
    server.answer(Answer(200, json.dumps({"decision_id": "d1", "external_tokens": 0, "children": []}).encode()))
    return Side(transport.HTTPClient(server.url, timeout=5.0, retry_deadline=5.0))


def test_traceparent_reaches_the_lookup_http_request(http_server: ScriptedServer):
    """The request's traceparent and tracestate, named in any case, are
    the lookup call's W3C headers (the lookup's otelhttp continues them)."""
    side = http_side(http_server)
    req = request(tokens=40, trace_headers={"TraceParent": TP, "Tracestate": "congo=t61rcWkgMzE"})
    assert side.ask(req) == (0, False)
    [seen] = http_server.requests()
    assert seen.path == "/v1/lookup" and json.loads(seen.body)["request_id"] == "r1"
    assert seen.headers["traceparent"] == TP and seen.headers["tracestate"] == "congo=t61rcWkgMzE"
    assert side.stats.get("traceparent_invalid") == 0


@pytest.mark.parametrize("trace_headers", UNTRACED)
def test_lookup_without_a_valid_traceparent_sends_none(http_server: ScriptedServer, trace_headers):
    """No traceparent, or one that is not valid W3C: the lookup goes out as
    for an untraced request (no trace header at all) and still answers."""
    side = http_side(http_server)
    assert side.ask(request(tokens=40, trace_headers=trace_headers)) == (0, False)
    [seen] = http_server.requests()
    assert "traceparent" not in seen.headers and "tracestate" not in seen.headers
    invalid = bool(trace_headers) and "traceparent" in trace_headers
    assert side.stats.get("traceparent_invalid") == int(invalid)


def test_every_event_of_a_traced_request_carries_its_traceparent():
    """admitted, allocated, scheduled, preempted, resumed and finished
    events of a traced request carry its traceparent; another request in
    the same records carries none."""
    side = Side(FakeLookup(hit=0))
    traced, plain = request("t", 32, {"traceparent": TP}), request("p", 32)
    for r in (traced, plain):
        side.ask(r)
        side.s.update_state_after_alloc(r, fv.KVCacheBlocks(([1, 2], [3, 4]) if r is traced else ([5, 6], [7, 8])), 0)
    so = fv.SchedulerOutput(scheduled_new_reqs=[fv.NewRequestData("t", traced.prompt_token_ids, ([1, 2], [3, 4]), 0),
                                                fv.NewRequestData("p", plain.prompt_token_ids, ([5, 6], [7, 8]), 0)],
                            num_scheduled_tokens={"t": 32, "p": 32}, total_num_scheduled_tokens=64)
    side.s.build_connector_meta(so)
    side.s.update_connector_output(fv.KVConnectorOutput())
    side.s.build_connector_meta(fv.SchedulerOutput(preempted_req_ids={"t"}))
    side.ask(traced)
    side.s.update_state_after_alloc(traced, fv.KVCacheBlocks(([9, 10], [11, 12])), 0)
    cr = fv.CachedRequestData(req_ids=["t"], resumed_req_ids={"t"}, new_block_ids=[([9, 10], [11, 12])], num_computed_tokens=[0])
    side.s.build_connector_meta(fv.SchedulerOutput(scheduled_cached_reqs=cr, num_scheduled_tokens={"t": 32}, total_num_scheduled_tokens=32))
    side.s.update_connector_output(fv.KVConnectorOutput())
    side.s.request_finished(traced, [[9, 10], [11, 12]])
    side.s.request_finished(plain, [[5, 6], [7, 8]])
    side.s.update_connector_output(fv.KVConnectorOutput())
    mine = [e for e in side.events() if e["request_id"] == "t"]
    assert [e["kind"] for e in mine] == ["admitted", "allocated", "scheduled", "preempted", "allocated", "scheduled", "finished"]
    assert all(e.get("traceparent") == TP for e in mine)
    others = [e for e in side.events() if e["request_id"] == "p"]
    assert others and all("traceparent" not in e for e in others)


@pytest.mark.parametrize("trace_headers", UNTRACED)
def test_events_without_a_valid_traceparent_have_no_field(trace_headers):
    side = Side(FakeLookup(hit=0))
    req = request(tokens=16, trace_headers=trace_headers)
    side.ask(req)
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1], [2])), 0)
    side.s.build_connector_meta(new_step(req, ([1], [2]), 16))
    side.s.update_connector_output(fv.KVConnectorOutput())
    side.s.request_finished(req, [[1], [2]])
    side.s.update_connector_output(fv.KVConnectorOutput())
    evs = side.events()
    assert [e["kind"] for e in evs] == ["admitted", "allocated", "scheduled", "finished"]
    assert all("traceparent" not in e for e in evs)
    assert all(b'traceparent' not in json.dumps(r).encode() for r in side.records)


def test_trace_context_is_taken_once_and_forgotten_at_the_finish():
    """The context is remembered from the first time the connector sees the
    request, and forgotten with the request's other state: a later request
    under the same id carries its own."""
    side = Side(FakeLookup(hit=0))
    req = request(tokens=16, trace_headers={"traceparent": TP})
    side.ask(req)
    req.trace_headers = {"traceparent": TP2}  # later changes are not taken
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(([1], [2])), 0)
    side.s.build_connector_meta(new_step(req, ([1], [2]), 16))
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert side.s.request_finished(req, [[1], [2]]) == (True, None)
    side.s.update_connector_output(fv.KVConnectorOutput(finished_sending={"r1"}))
    assert "r1" not in side.s._reqs, "the finished request's state (and trace context) was kept"
    assert {e.get("traceparent") for e in side.events()} == {TP}
    again = request(tokens=16, trace_headers={"traceparent": TP2})
    side.ask(again)
    side.s.update_state_after_alloc(again, fv.KVCacheBlocks(([3], [4])), 0)
    side.s.build_connector_meta(new_step(again, ([3], [4]), 16))
    side.s.update_connector_output(fv.KVConnectorOutput())
    assert [e.get("traceparent") for e in side.events()[4:]] == [TP2, TP2, TP2]


def _admitted(side: Side, req) -> dict:
    """The admitted event the connector publishes for ``req``."""
    assert side.ask(req) == (0, False)
    table = ([1, 2, 3], [4, 5, 6])
    side.s.update_state_after_alloc(req, fv.KVCacheBlocks(table), 0)
    side.s.build_connector_meta(new_step(req, table, req.num_tokens))
    side.s.update_connector_output(fv.KVConnectorOutput())
    evs = [e for e in side.events() if e["kind"] == "admitted"]
    assert len(evs) == 1
    return evs[0]


@pytest.mark.parametrize("tokens, want", [
    (40, 32),  # two complete hash blocks; the 8-token tail is not sent
    (48, 48),  # every token is in a complete block
    (15, 0),  # no complete block: no token_ids field
    (32768 + 40, 32768),  # at most MAX_TOKEN_IDS, whole hash blocks
])
def test_admitted_carries_the_complete_hash_blocks_tokens(tokens, want):
    """token_ids are the prompt's tokens of complete hash blocks only
    (what the scheduler accepts), lora_name the request's adapter."""
    side = Side(FakeLookup(hit=0))
    req = request(tokens=tokens)
    req.lora_request = type("LoRARequest", (), {"lora_name": "sql-lora"})()
    ev = _admitted(side, req)
    assert ev.get("token_ids", []) == req.prompt_token_ids[:want]
    assert len(ev.get("token_ids", [])) <= 16 * len(ev.get("block_hashes", []))
    assert ev["lora_name"] == "sql-lora"


def test_admitted_without_lora_or_token_ids_when_turned_off():
    """kvmesh.send_token_ids false: neither token_ids nor lora_name; a
    request without an adapter never has lora_name."""
    side = Side(FakeLookup(hit=0))
    side.s._s = cfg.Settings(engine_id="e1", model="hybrid", lookup_url="http://x", kafka={}, send_token_ids=False)
    req = request(tokens=40)
    req.lora_request = type("LoRARequest", (), {"lora_name": "sql-lora"})()
    ev = _admitted(side, req)
    assert "token_ids" not in ev and "lora_name" not in ev and len(ev["block_hashes"]) == 2
    plain = Side(FakeLookup(hit=0))
    ev = _admitted(plain, request(tokens=40))
    assert "lora_name" not in ev and len(ev["token_ids"]) == 32


@pytest.mark.parametrize("value, want", [(None, True), (True, True), ("false", False), ("0", False), (False, False), ("on", True)])
def test_send_token_ids_setting(value, want):
    extra = {"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l"}
    if value is not None:
        extra["kvmesh.send_token_ids"] = value
    assert cfg.load(extra, env={"KVMESH_KAFKA_BROKERS": "127.0.0.1:9092"}).send_token_ids is want


def test_send_token_ids_setting_refuses_other_values():
    extra = {"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l", "kvmesh.send_token_ids": "maybe"}
    with pytest.raises(cfg.KVMeshConfigError, match="send_token_ids"):
        cfg.load(extra, env={"KVMESH_KAFKA_BROKERS": "127.0.0.1:9092"})


def test_engine_version_on_lookups_and_admitted():
    """The engine states its version on every lookup and on the admitted
    event (a mesh whose model pins another refuses them); none stated: no
    field."""
    side = Side(FakeLookup(hit=0))
    side.s._s = cfg.Settings(engine_id="e1", model="hybrid", lookup_url="http://x", kafka={}, engine_version="0.11.2+cu128")
    ev = _admitted(side, request(tokens=40))
    assert ev["engine_version"] == "0.11.2+cu128"
    assert side.lookup.calls and all(c["engine_version"] == "0.11.2+cu128" for c in side.lookup.calls)
    plain = Side(FakeLookup(hit=0))
    ev = _admitted(plain, request(tokens=40))
    assert "engine_version" not in ev and all("engine_version" not in c for c in plain.lookup.calls)


@pytest.mark.parametrize("value, want", [
    (None, cfg.vllm_version()),  # vLLM's own version by default
    ("0.12.0", "0.12.0"),
    ("", ""),  # stated as none
])
def test_engine_version_setting(value, want):
    extra = {"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l"}
    if value is not None:
        extra["kvmesh.engine_version"] = value
    assert cfg.load(extra, env={"KVMESH_KAFKA_BROKERS": "127.0.0.1:9092"}).engine_version == want


def test_model_defaults_to_vllms_served_model_name():
    extra = {"kvmesh.engine_id": "e", "kvmesh.lookup_url": "http://l"}
    env = {"KVMESH_KAFKA_BROKERS": "127.0.0.1:9092"}
    assert cfg.load(extra, env=env, served_model="dense-8b").model == "dense-8b"
    assert cfg.load({**extra, "kvmesh.model": "full-swa-mamba"}, env=env, served_model="dense-8b").model == "full-swa-mamba"
    with pytest.raises(cfg.KVMeshConfigError, match="kvmesh.model"):
        cfg.load(extra, env=env)

    class ModelConfig:
        served_model_name = ["dense-8b", "alias"]

    class VllmConfig:
        model_config = ModelConfig()

    assert cfg.served_model_name(VllmConfig()) == "dense-8b"
    assert cfg.served_model_name(object()) == ""


def test_engine_version_setting_refuses_what_the_mesh_would():
    extra = {"kvmesh.engine_id": "e", "kvmesh.model": "m", "kvmesh.lookup_url": "http://l", "kvmesh.engine_version": "0.12 rc1"}
    with pytest.raises(cfg.KVMeshConfigError, match="engine_version"):
        cfg.load(extra, env={"KVMESH_KAFKA_BROKERS": "127.0.0.1:9092"})
