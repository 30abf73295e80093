"""The connector against a running mesh, driven as vLLM drives it.

Run by ``e2e/vllm_connector_test.go`` (``TestVLLMConnector``), which starts
the mesh, writes mesh.json and the workload, and compares this harness's
report with the Go simulator's for the same workload.
"""

from __future__ import annotations

import pytest

from kvmesh_vllm.errors import KVMeshConfigError, MeshUnreachableError, ModelMismatchError

import engine as eng_mod
import harness as h


def _salt(workload: dict) -> bytes:
    return str(workload.get("salt") or workload.get("run_tag") or "kvmesh-harness").encode()


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
        "tokens_loaded": dict(st.tokens_loaded),
        "hit_rate": round(loaded / st.prompt_tokens, 4) if st.prompt_tokens else 0.0,
        "blocks_checked": st.blocks_checked,
        "blocks_mismatched": st.blocks_mismatched,
        "load_error_blocks": st.load_error_blocks,
        "recomputed_tokens": st.recomputed_tokens,
        "preemptions": st.preemptions,
        "steps": st.steps,
        "saves": ledger.outcomes(),
        "connector_stats": sched.reduce(),
        "worker_stats": [w.stats.reduce() for w in built.workers],
    }


def test_kvmesh_alone(mesh, workload, harness_report):
    """kvmesh as the engine's only connector (its own pd,store chain):
    every loaded block right, every save answered, nothing raised."""
    built = h.build(mesh, h.engine_of(mesh, "decode"), _salt(workload))
    ledger = h.Ledger(built.scheduler.settings.engine_id).start(built.scheduler.settings.kafka)
    try:
        _play(built, workload["requests"])
        balanced = ledger.settle()
        rep = _report_engine(built, ledger)
        rep["ledger_balanced"] = balanced and rep["saves"]["tasks"] == rep["saves"]["results"]
        rep["malformed_saves"] = ledger.malformed(len(built.model.groups))
        harness_report.update(rep)
    finally:
        ledger.close()
        built.close()
    st = built.engine.stats
    assert st.failures == [], st.failures[:5]
    assert st.blocks_mismatched == 0
    assert st.requests_ok == st.requests_total == len(workload["requests"])
    assert rep["ledger_balanced"], rep["saves"]
    assert rep["saves"]["stored"] + rep["saves"]["existing"] > 0, "nothing was saved"
    assert st.tokens_loaded.get("store", 0) > 0 and st.blocks_checked > 0, st.tokens_loaded
    assert rep["malformed_saves"] == []
    assert built.scheduler.stats.get("publish_failures") == 0


def test_multiconnector_pd_child_wins(mesh, workload, harness_report):
    """kvmesh as the store child of vLLM's MultiConnector behind a P/D
    connector that supplies the first turns' tokens.

    With test_kvmesh_alone's salt kvmesh's lookups hit, the P/D child is
    chosen and kvmesh is told 0 external tokens — the seed's crash path:
    nothing may be saved from that rejected load. With a fresh salt kvmesh
    misses, and the blocks the P/D child filled must be saved whole (their
    identities recorded at the request's first step), none dead-lettered."""
    e = h.engine_of(mesh, "prefill")
    firsts = [p for p in workload["requests"] if not p.get("after")]
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


def test_lookup_unreachable_never_raises(mesh, workload, harness_report):
    """With the lookup service unreachable the engine computes every
    request itself: lookups fail open, nothing raises."""
    e = h.engine_of(mesh, "decode")
    built = h.build(mesh, e, b"unreachable-lookup", lookup_url="http://127.0.0.1:1", lookup_deadline_s=0.5)
    try:
        _play(built, workload["requests"][:2], prefix="down-")
    finally:
        built.close()
    assert built.engine.stats.requests_ok == 2
    assert built.scheduler.stats.get("lookup_failures") >= 2
    harness_report["lookup_unreachable"] = {"requests_ok": built.engine.stats.requests_ok,
                                            "lookup_failures": built.scheduler.stats.get("lookup_failures")}


@pytest.mark.parametrize("override, error, words", [
    ({"model": "another-model"}, ModelMismatchError, "serves model"),
    ({"gpuworker_urls": ["http://127.0.0.1:1"], "start_deadline_s": 0.5}, MeshUnreachableError, "unreachable"),
    ({"lookup_url": "ftp://nowhere"}, KVMeshConfigError, "lookup_url"),
    ({"tenant": "no spaces allowed"}, KVMeshConfigError, "tenant"),
])
def test_misconfiguration_is_a_clear_error(mesh, override, error, words):
    """Every misconfiguration fails when vLLM builds the connector, naming it."""
    with pytest.raises(error, match=words):
        h.build(mesh, h.engine_of(mesh, "decode"), b"x", **override)
