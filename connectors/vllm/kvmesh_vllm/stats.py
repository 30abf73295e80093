"""The connector's counters, for vLLM's stats and Prometheus.

vLLM collects connector stats from the workers
(``get_kv_connector_stats``), merges them (``aggregate``) and logs or
exports them (``reduce``, and the Prometheus families of
``build_prom_metrics``). :class:`ConnectorStats` holds counters by name;
the names are listed in ``COUNTERS`` with their meaning.
"""

from __future__ import annotations

import threading
from typing import Any

#: Every counter and what it counts.
COUNTERS = {
    "lookups": "lookups asked of kvmesh",
    "lookups_skipped": "requests not looked up: this vLLM cannot take a connector's tokens for the model (Mamba layers on vLLM before the aligned split accepted them)",
    "lookup_pending": "lookups kvmesh answered 'not yet' (asked again)",
    "lookup_failures": "lookups that failed (unreachable, refused, malformed); the engine computed",
    "lookup_anomalies": "lookup answers that did not fit the engine's state; not acted on",
    "lookups_not_chosen": "lookups with a hit another connector (MultiConnector) was chosen over",
    "loads": "loads kvmesh was asked for",
    "load_tokens": "tokens kvmesh was asked to load",
    "load_error_blocks": "blocks whose load failed (recomputed, or the request failed, per vLLM's kv_load_failure_policy)",
    "load_recomputes": "hybrid-model requests whose load failed, sent back to their local prefix and recomputed (vLLM up to 2026-08-22, whatever kv_load_failure_policy says)",
    "load_failures_reported": "hybrid-model requests whose load failed, reported to vLLM as failed_recving (vLLM after 2026-08-22), which recomputes or fails them per kv_load_failure_policy",
    "load_timeouts": "loads given up after kvmesh.load_timeout_s; every block recomputed",
    "foreign_tokens": "tokens another connector supplied, recorded as the blocks' identity",
    "preemptions": "preempted requests",
    "records": "engine step records published (acknowledged by the brokers)",
    "steps": "scheduler steps the connector built metadata for",
    "step_us": "microseconds the scheduler side spent in build_connector_meta and update_connector_output",
    "publish_failures": "engine step records that could not be published; their requests fail closed",
    "finished_sending": "requests kvmesh reported saved (blocks freed)",
    "finish_timeouts": "finished requests freed after kvmesh.finish_timeout_s without kvmesh's report",
    "request_errors": "requests kvmesh stopped (request_error feedback)",
    "blocks_recorded": "block identities recorded in the registered KV memory",
    "blocks_busy": "block identities not recorded because a load was writing the block",
    "bad_feedback": "feedback records that could not be decoded",
    "tenant_invalid": "requests whose tenant was refused; served without a tenant",
    "traceparent_invalid": "requests whose trace headers held a traceparent that is not valid W3C; served without a trace context",
}


class ConnectorStats:
    """Thread-safe counters by name."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data: dict[str, int] = {k: int(v) for k, v in (data or {}).items()}
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to a counter of ``COUNTERS``."""
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self.data[name] = self.data.get(name, 0) + n

    def get(self, name: str) -> int:
        """A counter's value."""
        with self._lock:
            return self.data.get(name, 0)

    def take(self) -> "ConnectorStats":
        """The counters since the last take, reset to zero."""
        with self._lock:
            out, self.data = ConnectorStats(self.data), {}
        return out

    def aggregate(self, other: "ConnectorStats") -> "ConnectorStats":
        """Adds another instance's counters into this one."""
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        """Whether every counter is zero."""
        return not any(self.data.values())

    def reduce(self) -> dict[str, int]:
        """The counters to log."""
        return dict(sorted(self.data.items()))

    def reset(self) -> None:
        """Sets every counter to zero."""
        with self._lock:
            self.data = {}
