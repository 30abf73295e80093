"""A vLLM request's W3C trace context, as the connector carries it.

vLLM keeps the trace headers its client sent (``traceparent``,
``tracestate``) on ``vllm.v1.request.Request.trace_headers``, a
``Mapping[str, str]`` or None. The connector passes the request's
``traceparent`` (and ``tracestate``) on to kvmesh: as HTTP headers of the
lookup, and as the ``traceparent`` field of every request event it
publishes, so kvmesh's spans of the request join the client's trace.

Only a syntactically valid ``traceparent`` (W3C Trace Context, version
``00``) is passed on; anything else is dropped, never raised.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: version 00: ``00-<trace id>-<parent id>-<flags>``, lowercase hex only.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
#: One tracestate list member: ``key=value`` (W3C's key and value grammar).
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z0-9][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
#: W3C: at most 32 list members; vendors need propagate no more than 512 characters.
MAX_TRACESTATE_MEMBERS = 32
MAX_TRACESTATE_LEN = 512


@dataclass(frozen=True)
class TraceContext:
    """The trace context of one request; empty when it has none.

    ``invalid``: the request carried a ``traceparent`` that is not valid
    (dropped, so the request is served as one without a trace)."""

    traceparent: str = ""
    tracestate: str = ""
    invalid: bool = False

    def headers(self) -> dict[str, str]:
        """The HTTP headers that carry this context (none when empty)."""
        if not self.traceparent:
            return {}
        out = {TRACEPARENT: self.traceparent}
        if self.tracestate:
            out[TRACESTATE] = self.tracestate
        return out


def valid_traceparent(value: Any) -> bool:
    """Whether ``value`` is a W3C ``traceparent`` of version 00 with a
    trace id and a parent id that are not all zeros."""
    if not isinstance(value, str):
        return False
    m = _TRACEPARENT.fullmatch(value)
    return m is not None and m.group(1) != "0" * 32 and m.group(2) != "0" * 16


def valid_tracestate(value: Any) -> bool:
    """Whether ``value`` is a W3C ``tracestate`` list worth propagating
    (empty members allowed, at most 32 members and 512 characters)."""
    if not isinstance(value, str) or not value or len(value) > MAX_TRACESTATE_LEN:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > MAX_TRACESTATE_MEMBERS:
        return False
    return all(_TRACESTATE_MEMBER.fullmatch(m) for m in members)


def _header(headers: Mapping[Any, Any], name: str) -> Optional[str]:
    """The value of header ``name`` whatever the case of its key; None when
    absent. Two keys differing in case with different values: ValueError."""
    found: Optional[str] = None
    for k, v in headers.items():
        if not isinstance(k, str) or k.lower() != name:
            continue
        if not isinstance(v, str):
            raise ValueError(f"{name} is a {type(v).__name__}")
        v = v.strip(" \t")
        if found is not None and v != found:
            raise ValueError(f"{name} given twice")
        found = v
    return found


def trace_context(headers: Any) -> TraceContext:
    """The trace context in a request's ``trace_headers``; never raises."""
    if not isinstance(headers, Mapping):
        return TraceContext()
    try:
        parent = _header(headers, TRACEPARENT)
    except Exception:  # a mapping of the wrong shape: treated as no valid one
        return TraceContext(invalid=True)
    if parent is None:
        return TraceContext()
    if not valid_traceparent(parent):
        return TraceContext(invalid=True)
    try:
        state = _header(headers, TRACESTATE) or ""
    except Exception:
        state = ""
    return TraceContext(parent, state if valid_tracestate(state) else "")


def of_request(request: Any) -> TraceContext:
    """The trace context of a vLLM ``Request`` (its ``trace_headers``);
    never raises."""
    try:
        headers = getattr(request, "trace_headers", None)
    except Exception:
        return TraceContext()
    return trace_context(headers)
