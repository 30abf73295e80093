"""The connector against a running mesh, driven as vLLM drives it.

Run by ``e2e/vllm_connector_test.go`` (``TestVLLMConnector``), which starts
the mesh, writes mesh.json and the workload, and compares this harness's
report with the Go simulator's for the same workload.
"""

from __future__ import annotations

import copy
import http.server
import threading

import pytest

from kvmesh_vllm.errors import KVMeshConfigError, MeshUnreachableError, ModelMismatchError, UnsupportedLayoutError

import engine as eng_mod
import harness as h


def _salt(workload: dict) -> bytes:
    return str(workload.get("salt") or workload.get("run_tag") or "kvmesh-harness").encode()


def _firsts(workload: dict) -> list[dict]:
    """The plan's first turns: requests that wait for no other."""
    return [p for p in workload["requests"] if not p.get("after")]


def _play(built: h.Built, plan: list[dict], prefix: str = "", params=None) -> None:
    eng_mod.run(built.engine, plan, lambda p: h.request_of(built, p, prefix, params(p) if params else None))


def _report_engine(built: h.Built, ledger: h.Ledger) -> dict:
    st = built.engine.stats
    sched = built.scheduler.stats
    loaded = sum(st.tokens_loaded.values())
    return {
        "requests_total": st.requests_total,
        "requests_ok": st.requests_ok,
        "requests_failed": st.requests_total - st.requests_ok,
        "prompt_tokens": st.prompt_tokens,
        "tokens_local": st.local_tokens,
        "tokens_loaded": {"store": 0, "pd": 0, **st.tokens_loaded},
        "hit_rate": round((st.local_tokens + loaded) / st.prompt_tokens, 4) if st.prompt_tokens else 0.0,
        "blocks_checked": st.blocks_checked,
        "blocks_mismatched": st.blocks_mismatched,
        "load_error_blocks": st.load_error_blocks,
        "recomputed_tokens": st.recomputed_tokens,
        "preemptions": st.preemptions,
        "steps": st.steps,
        "connector_us_per_step": round(sched.get("step_us") / max(1, sched.get("steps")), 1),
        "saves": ledger.outcomes(),
        "connector_stats": sched.reduce(),
        "worker_stats": [w.stats.reduce() for w in built.workers],
    }


def _play_checked(mesh: dict, workload: dict, prefix: str) -> dict:
    """Plays the workload on a fresh engine (new connectors, empty KV
    memory) and checks it: every request done, every loaded block right,
    every save answered, nothing raised. Returns the run's report."""
    built = h.build(mesh, h.engine_of(mesh, "decode"), _salt(workload))
    ledger = h.Ledger(built.scheduler.settings.engine_id).start(built.scheduler.settings.kafka)
    try:
        _play(built, workload["requests"], prefix=prefix)
        balanced = ledger.settle()
        rep = _report_engine(built, ledger)
        rep["ledger_balanced"] = balanced and rep["saves"]["tasks"] == rep["saves"]["results"]
        rep["malformed_saves"] = ledger.malformed(len(built.model.groups))
    finally:
        ledger.close()
        built.close()
    st = built.engine.stats
    assert st.failures == [], st.failures[:5]
    assert st.blocks_mismatched == 0
    assert st.requests_ok == st.requests_total == len(workload["requests"])
    assert rep["ledger_balanced"], rep["saves"]
    assert rep["malformed_saves"] == []
    assert built.scheduler.stats.get("publish_failures") == 0
    return rep


def test_kvmesh_alone(mesh, workload, harness_report):
    """kvmesh as the engine's only connector (its own pd,store chain).

    The workload is played twice: on a cold engine, whose saves fill the
    store, then on a restarted engine (new connectors, empty KV memory and
    prefix cache) with the same prompts, which must load them back from
    the store byte for byte."""
    cold = _play_checked(mesh, workload, prefix="")
    harness_report.update(cold)
    assert cold["saves"]["stored"] > 0, "nothing was stored"
    replay = _play_checked(mesh, workload, prefix="replay-")
    harness_report["replay"] = replay
    assert replay["tokens_loaded"].get("store", 0) > 0, replay["tokens_loaded"]
    assert replay["blocks_checked"] > 0


def test_multiconnector_pd_child_wins(mesh, workload, harness_report):
    """kvmesh as the store child of vLLM's MultiConnector behind a P/D
    connector that supplies the first turns' tokens.

    With test_kvmesh_alone's salt kvmesh's lookups hit, the P/D child is
    chosen and kvmesh is told 0 external tokens — the seed's crash path:
    nothing may be saved from that rejected load. With a fresh salt kvmesh
    misses, and the blocks the P/D child filled must be saved whole (their
    identities recorded at the request's first step), none dead-lettered."""
    e = h.engine_of(mesh, "prefill")
    firsts = _firsts(workload)
    report = {}
    for phase, salt in (("store_hit", _salt(workload)), ("store_miss", _salt(workload) + b"-fresh")):
        built = h.build(mesh, e, salt, pd_child=True)
        ledger = h.Ledger(built.scheduler.settings.engine_id).start(built.scheduler.settings.kafka)
        prefix = f"mc-{phase}-"
        try:
            sbs = built.model.scheduler_block_size

            def params(p):  # the P/D child claims every whole block but the prompt's last token
                return {"fake_pd_tokens": (len(p["prompt_token_ids"]) - 1) // sbs * sbs}
            _play(built, firsts, prefix=prefix, params=params)
            balanced = ledger.settle()
            ids = {prefix + p["request_id"] for p in firsts}
            pd_chosen = ids & built.engine.pd.chosen
            outcome = ledger.outcomes(pd_chosen)
            bad = ledger.malformed(len(built.model.groups), pd_chosen)
            report[phase] = {
                "requests": len(firsts), "pd_chosen": len(pd_chosen), "balanced": balanced,
                "kvmesh_lost_lookups": built.scheduler.stats.get("lookups_not_chosen"),
                "foreign_tokens": built.scheduler.stats.get("foreign_tokens"),
                "blocks_recorded": sum(w.stats.get("blocks_recorded") for w in built.workers),
                "saves": outcome, "malformed": bad,
            }
        finally:
            ledger.close()
            built.close()
        st = built.engine.stats
        assert st.failures == [] and st.blocks_mismatched == 0, st.failures[:5]
        assert st.requests_ok == len(firsts) and pd_chosen == ids, (phase, st.requests_ok, pd_chosen)
        assert balanced and bad == [] and outcome["dead_lettered"] == 0 and outcome["failed"] == 0, (phase, bad, outcome)
        assert built.scheduler.stats.get("foreign_tokens") > 0, "kvmesh never recorded the P/D child's blocks"
    harness_report["multiconnector"] = report
    harness_report["multiconnector_saves_from_rejected"] = sum(len(r["malformed"]) + r["saves"]["dead_lettered"] for r in report.values())
    assert report["store_hit"]["kvmesh_lost_lookups"] == len(firsts), "kvmesh's lookups did not hit, so it never lost to the P/D child"
    assert report["store_miss"]["saves"]["stored"] > 0, "the P/D-loaded blocks were never stored"


def test_preemption_under_pressure(mesh, workload, harness_report):
    """A pool that holds one large request at a time: running requests are
    preempted (their blocks freed and reused at once, saves of them maybe
    still in flight) and resumed; every loaded block stays right, every
    save is answered (a save whose blocks were reused is dead-lettered
    block_not_held, never stored from the new bytes)."""
    probe = h.build(mesh, h.engine_of(mesh, "decode"), b"-")
    need = h.max_blocks(probe.model, workload["requests"])
    probe.close()
    # Prefill in 32-token chunks: many requests start small, then grow
    # into a pool that holds the largest one and a few blocks more.
    built = h.build(mesh, h.engine_of(mesh, "decode"), _salt(workload) + b"-tight", num_blocks=need + 4,
                    max_batch_tokens=32)
    ledger = h.Ledger(built.scheduler.settings.engine_id).start(built.scheduler.settings.kafka)
    try:
        _play(built, workload["requests"], prefix="tight-")
        balanced = ledger.settle()
        rep = _report_engine(built, ledger)
    finally:
        ledger.close()
        built.close()
    harness_report["preemption"] = rep
    st = built.engine.stats
    assert st.failures == [] and st.blocks_mismatched == 0, st.failures[:5]
    assert st.requests_ok == len(workload["requests"])
    assert st.preemptions > 0, "the pool never ran short"
    assert built.scheduler.stats.get("preemptions") == st.preemptions
    assert balanced and rep["saves"]["tasks"] == rep["saves"]["results"], rep["saves"]


def test_load_errors_are_recomputed(mesh, workload, harness_report):
    """Store keys removed between the lookup and the load: kvmesh reports
    the blocks as load errors (get_block_ids_with_load_errors), the engine
    recomputes from the first one, and every block it kept is right."""
    salt = _salt(workload)
    built = h.build(mesh, h.engine_of(mesh, "decode"), salt)
    removed = []

    def drop_keys(r):  # the Mamba state at the hit: the load's last chunk of group 1
        who, start, hit = r.load
        g = len(built.model.groups) - 1
        p = hit // built.model.groups[g].block_size - 1
        key = h.store_key(mesh, g, built.engine._chunk_hash(r, g, p))
        removed.append(h.redis_command(mesh["redis_url"], "DEL", key))
    built.engine.on_load_issued = drop_keys
    try:
        _play(built, _firsts(workload)[:4], prefix="lost-")
    finally:
        built.close()
    st = built.engine.stats
    harness_report["load_errors"] = {"keys_removed": sum(removed), "load_error_blocks": st.load_error_blocks,
                                     "recomputed_tokens": st.recomputed_tokens, "blocks_checked": st.blocks_checked}
    assert sum(removed) > 0, "no store key was there to remove: the replay loaded nothing"
    assert st.load_error_blocks > 0 and st.recomputed_tokens > 0, harness_report["load_errors"]
    assert st.failures == [] and st.blocks_mismatched == 0 and st.requests_ok == 4


def test_failed_saves_are_reported(mesh, workload, harness_report):
    """Every block identity in the engine's KV memory cleared after each
    step (the gpuworker's POST /v1/pool/reset): saves of those blocks fail
    closed — dead-lettered block_not_held, reported on the save's result —
    the requests still get their finished_sending, and nothing raises into
    the engine."""
    from kvmesh_vllm import transport

    e = h.engine_of(mesh, "decode")
    built = h.build(mesh, e, _salt(workload) + b"-reset")
    ledger = h.Ledger(built.scheduler.settings.engine_id).start(built.scheduler.settings.kafka)
    admin = transport.HTTPClient(e["gpuworkers"][0]["url"], token=mesh["admin_token"], retry_deadline=5)
    built.engine.on_step_done = lambda _: admin.request("POST", "/v1/pool/reset")
    try:
        _play(built, _firsts(workload)[:3], prefix="reset-")
        balanced = ledger.settle()
        outcome = ledger.outcomes()
    finally:
        ledger.close()
        built.close()
    harness_report["failed_saves"] = outcome
    st = built.engine.stats
    assert st.requests_ok == 3 and st.failures == []
    assert balanced and outcome["tasks"] == outcome["results"], outcome
    assert outcome["dead_lettered"] > 0, f"no save failed closed after the resets: {outcome}"
    assert built.workers[0].stats.get("finished_sending") == 3 and built.workers[0].stats.get("finish_timeouts") == 0


def test_lookup_failing_never_raises(mesh, workload, harness_report):
    """A lookup service that answers 503 to every lookup: the connector
    retries until kvmesh.lookup_deadline_s, then the engine computes the
    request itself; nothing raises."""
    calls = []

    class Lookup(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # /healthz, the connector's start-up check
            self.send_response(200)
            self.end_headers()

        def do_POST(self):
            calls.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(503)
            self.send_header("Content-Type", "application/problem+json")
            self.end_headers()
            self.wfile.write(b'{"title": "Service Unavailable", "status": 503}')

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lookup)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        built = h.build(mesh, h.engine_of(mesh, "decode"), b"failing-lookup",
                        lookup_url=f"http://127.0.0.1:{srv.server_port}", lookup_deadline_s=0.3)
        try:
            _play(built, _firsts(workload)[:2], prefix="down-")
        finally:
            built.close()
    finally:
        srv.shutdown()
    assert built.engine.stats.requests_ok == 2
    assert built.scheduler.stats.get("lookup_failures") >= 2 and len(calls) >= 2
    harness_report["lookup_failing"] = {"requests_ok": built.engine.stats.requests_ok,
                                        "lookup_failures": built.scheduler.stats.get("lookup_failures"), "lookup_calls": len(calls)}


@pytest.mark.parametrize("override, error, words", [
    ({"model": "another-model"}, ModelMismatchError, "serves model"),
    ({"gpuworker_urls": ["http://127.0.0.1:1"], "start_deadline_s": 0.5}, MeshUnreachableError, "gpuworker .* unreachable"),
    ({"lookup_url": "http://127.0.0.1:1", "start_deadline_s": 0.5}, MeshUnreachableError, "lookup service .* unreachable"),
    ({"kafka_brokers": "127.0.0.1:1", "start_deadline_s": 1}, MeshUnreachableError, "Kafka is unreachable"),
    ({"lookup_url": "ftp://nowhere"}, KVMeshConfigError, "lookup_url"),
    ({"tenant": "no spaces allowed"}, KVMeshConfigError, "tenant"),
])
def test_misconfiguration_is_a_clear_error(mesh, override, error, words):
    """Every misconfiguration fails when vLLM builds the connector, naming it."""
    with pytest.raises(error, match=words):
        h.build(mesh, h.engine_of(mesh, "decode"), b"x", **override)


def test_layout_mismatch_is_refused(mesh):
    """vLLM's KV cache with another block size in bytes than the mesh's
    model: register_kv_caches refuses it, naming both sizes."""
    other = copy.deepcopy(mesh)
    other["model"]["groups"][0]["bytes_per_block"] *= 2
    with pytest.raises(ModelMismatchError, match="group 0: the mesh stores"):
        h.build(other, h.engine_of(mesh, "decode"), b"x")


def test_parallel_layout_mismatch_is_refused(mesh):
    """vLLM running TP 2 against a mesh engine with one gpuworker."""
    e = copy.deepcopy(h.engine_of(mesh, "decode"))
    e["gpuworkers"] = e["gpuworkers"] * 2
    with pytest.raises(UnsupportedLayoutError, match="serves rank"):
        h.build(mesh, e, b"x")
    with pytest.raises(KVMeshConfigError, match="lists 1 gpuworkers"):
        h.build(mesh, e, b"x", gpuworker_urls=[e["gpuworkers"][0]["url"]])
