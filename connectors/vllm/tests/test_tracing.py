"""The W3C trace context the connector takes from a vLLM request's
``trace_headers`` (kvmesh_vllm.tracing): what is passed on, what is
dropped, and that nothing raises."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvmesh_vllm.tracing import TraceContext, of_request, trace_context, valid_traceparent, valid_tracestate

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value", [
    TP,
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",  # not sampled: still a context
    "00-00000000000000000000000000000001-0000000000000001-ff",
])
def test_valid_traceparent(value: str) -> None:
    assert valid_traceparent(value)


@pytest.mark.parametrize("value", [
    "",
    "garbage",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # all-zero parent id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # uppercase hex
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0G",
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # another version
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    TP + "-extra",
    TP + "\r\nX-Injected: 1",
    None,
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
])
def test_invalid_traceparent(value: Any) -> None:
    assert not valid_traceparent(value)


@pytest.mark.parametrize("value, ok", [
    ("congo=t61rcWkgMzE", True),
    ("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", True),
    ("tenant@vendor=v,,other=x", True),
    ("", False),
    ("noequals", False),
    ("Upper=v", False),
    ("k=v\r\nX-Injected: 1", False),
    (",".join(f"k{i}=v" for i in range(33)), False),  # more than 32 members
    ("k=" + "v" * 600, False),
])
def test_tracestate(value: str, ok: bool) -> None:
    assert valid_tracestate(value) is ok


def test_header_names_in_any_case() -> None:
    ctx = trace_context({"TraceParent": TP, "TRACESTATE": "congo=t61rcWkgMzE", "x-other": "1"})
    assert ctx == TraceContext(TP, "congo=t61rcWkgMzE")
    assert ctx.headers() == {"traceparent": TP, "tracestate": "congo=t61rcWkgMzE"}


@pytest.mark.parametrize("headers", [None, {}, {"tracestate": "congo=t61rcWkgMzE"}, "traceparent", [("traceparent", TP)]])
def test_no_traceparent_no_context(headers: Any) -> None:
    ctx = trace_context(headers)
    assert ctx == TraceContext() and ctx.headers() == {}


@pytest.mark.parametrize("headers", [
    {"traceparent": "00-00000000000000000000000000000000-0000000000000000-00"},
    {"traceparent": 7},
    {"traceparent": TP, "Traceparent": TP[:-2] + "00"},  # two different values
])
def test_invalid_traceparent_is_dropped_and_marked(headers: Any) -> None:
    ctx = trace_context(headers)
    assert ctx.invalid and not ctx.traceparent and ctx.headers() == {}


def test_invalid_tracestate_is_dropped_alone() -> None:
    ctx = trace_context({"traceparent": TP, "tracestate": "not a tracestate"})
    assert ctx == TraceContext(TP) and ctx.headers() == {"traceparent": TP}


def test_of_request_never_raises() -> None:
    class Broken:
        @property
        def trace_headers(self) -> Any:
            raise RuntimeError("boom")

    class BadMapping(dict):
        def items(self) -> Any:
            raise RuntimeError("boom")

    assert of_request(Broken()) == TraceContext()
    assert of_request(SimpleNamespace()) == TraceContext()  # an older Request without trace_headers
    assert of_request(SimpleNamespace(trace_headers=BadMapping(traceparent=TP))).invalid
    assert of_request(SimpleNamespace(trace_headers={"traceparent": TP})) == TraceContext(TP)
