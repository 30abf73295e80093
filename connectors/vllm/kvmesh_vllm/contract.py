"""kvmesh's contract as the connector speaks it: topics, schemas, records.

The Go types in kvmesh's ``pkg/contract`` and ``pkg/kvcore`` own these
shapes (``docs/contract.md`` describes every field); this module writes
and reads exactly their JSON, and nothing else of the connector builds a
record by hand.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

#: Topics the connector produces to and consumes from.
TOPIC_ENGINE_STEPS = "kvmesh.engine.steps"
TOPIC_ENGINE_FEEDBACK = "kvmesh.engine.feedback"

SCHEMA_ENGINE_STEP = "kvmesh.engine_step.v1"
SCHEMA_ENGINE_FEEDBACK = "kvmesh.engine_feedback.v1"
#: The record on the feedback topic: one engine's feedback messages of one
#: scheduler transaction (contract.EngineFeedbackBatch).
SCHEMA_ENGINE_FEEDBACK_BATCH = "kvmesh.engine_feedback_batch.v1"

#: Request event kinds (contract.EventKind).
EVENT_ADMITTED = "admitted"
EVENT_ALLOCATED = "allocated"
EVENT_SCHEDULED = "scheduled"
EVENT_PREEMPTED = "preempted"
EVENT_FINISHED = "finished"

#: Step kinds of a scheduled event (kvcore.StepKind).
STEP_NEW = "new"
STEP_RUNNING = "running"
STEP_RESUMED = "resumed"
STEP_DECODE = "decode"
STEP_PENDING_LOAD = "pending_load"

#: Feedback kinds (kvcore.FeedbackKind).
FEEDBACK_FINISHED_SENDING = "finished_sending"
FEEDBACK_FINISHED_RECVING = "finished_recving"
FEEDBACK_REQUEST_ERROR = "request_error"

#: At most this many request events in one step record (contract.MaxStepRequests).
MAX_STEP_REQUESTS = 4096

#: At most this many prompt token ids on an admitted event (kvcore.MaxTokenIDs:
#: kvmesh keeps no more of them), rounded down to whole hash blocks.
MAX_TOKEN_IDS = 32768

#: vLLM's null block id (block_pool.py's null_block, NULL_BLOCK_ID).
VLLM_NULL_BLOCK_ID = 0

BlockTable = list[list[int]]


def table_of(block_ids: Sequence[Sequence[int]]) -> BlockTable:
    """A block table (one list per group) from vLLM's tuple of lists."""
    return [list(map(int, g)) for g in block_ids]


@dataclass
class RequestEvent:
    """One request's event inside a step record (contract.RequestEvent)."""

    request_id: str
    kind: str
    seq: int = 0
    prompt_tokens: int = 0
    block_hashes: Optional[list[str]] = None
    token_ids: Optional[list[int]] = None
    lora_name: str = ""
    tenant: str = ""
    engine_version: str = ""
    consumer: bool = False
    external_tokens: int = 0
    block_table: Optional[BlockTable] = None
    decision_id: str = ""
    step: Optional[dict[str, Any]] = None
    traceparent: str = ""

    def to_json(self) -> dict[str, Any]:
        """The event as the scheduler decodes it (empty fields omitted)."""
        out: dict[str, Any] = {"request_id": self.request_id, "seq": self.seq, "kind": self.kind}
        if self.prompt_tokens:
            out["prompt_tokens"] = self.prompt_tokens
        if self.block_hashes:
            out["block_hashes"] = self.block_hashes
        if self.token_ids:
            out["token_ids"] = self.token_ids
        if self.lora_name:
            out["lora_name"] = self.lora_name
        if self.tenant:
            out["tenant"] = self.tenant
        if self.engine_version:
            out["engine_version"] = self.engine_version
        if self.consumer:
            out["consumer"] = True
        if self.external_tokens:
            out["external_tokens"] = self.external_tokens
        if self.block_table is not None:
            out["block_table"] = self.block_table
        if self.decision_id:
            out["decision_id"] = self.decision_id
        if self.step is not None:
            out["step"] = self.step
        if self.traceparent:
            out["traceparent"] = self.traceparent
        return out


def step_of(kind: str, tokens: int = 0, table: Optional[BlockTable] = None,
            hashes: Optional[list[str]] = None, prefill_tokens: int = 0) -> dict[str, Any]:
    """A scheduled event's step (kvcore.Step)."""
    out: dict[str, Any] = {"kind": kind, "block_table": table}
    if tokens:
        out["tokens"] = tokens
    if hashes:
        out["block_hashes"] = hashes
    if prefill_tokens:
        out["prefill_tokens"] = prefill_tokens
    return out


@dataclass
class EngineStep:
    """One engine step record on ``kvmesh.engine.steps`` (contract.EngineStep)."""

    engine_id: str
    model: str
    step: int
    requests: list[RequestEvent] = field(default_factory=list)
    null_block_id: Optional[int] = VLLM_NULL_BLOCK_ID
    step_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def encode(self) -> bytes:
        """The record value."""
        out: dict[str, Any] = {
            "schema": SCHEMA_ENGINE_STEP,
            "step_id": self.step_id,
            "engine_id": self.engine_id,
            "model": self.model,
            "step": self.step,
            "requests": [e.to_json() for e in self.requests],
        }
        if self.null_block_id is not None:
            out["null_block_id"] = self.null_block_id
        return json.dumps(out, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Feedback:
    """One ``kvmesh.engine.feedback`` message (contract.EngineFeedback)."""

    kind: str
    engine_id: str
    request_id: str
    immediate: bool = False
    load_errors: tuple[int, ...] = ()
    task_id: str = ""
    epoch: int = 0
    missing_ranks: tuple[dict[str, int], ...] = ()
    error: str = ""

    @staticmethod
    def messages(v: dict[str, Any]) -> "list[Any]":
        """The messages of a decoded feedback record, in order, each to be
        read with from_json (contract.DecodeEngineFeedback): a batch's list,
        or the record itself when it is one message (what a scheduler before
        the batch sent); raises ValueError for a batch without its list."""
        if isinstance(v, dict) and v.get("schema") == SCHEMA_ENGINE_FEEDBACK_BATCH:
            items = v.get("feedback")
            if not isinstance(items, list):
                raise ValueError("feedback batch without a feedback list")
            return items
        return [v]

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> "Feedback":
        """Reads one decoded feedback message; raises ValueError for another schema."""
        if not isinstance(v, dict):
            raise ValueError(f"feedback message {v!r} is not an object")
        if v.get("schema") != SCHEMA_ENGINE_FEEDBACK:
            raise ValueError(f"schema {v.get('schema')!r}, want {SCHEMA_ENGINE_FEEDBACK}")
        kind = v.get("kind")
        if kind not in (FEEDBACK_FINISHED_SENDING, FEEDBACK_FINISHED_RECVING, FEEDBACK_REQUEST_ERROR):
            raise ValueError(f"feedback kind {kind!r}")
        return cls(
            kind=str(kind),
            engine_id=str(v.get("engine_id", "")),
            request_id=str(v.get("request_id", "")),
            immediate=bool(v.get("immediate", False)),
            load_errors=tuple(int(b) for b in v.get("load_errors") or ()),
            task_id=str(v.get("task_id", "")),
            epoch=int(v.get("epoch", 0) or 0),
            missing_ranks=tuple(v.get("missing_ranks") or ()),
            error=str(v.get("error", "")),
        )


@dataclass(frozen=True)
class Decision:
    """The lookup's answer for one request (contract.LookupDecision)."""

    decision_id: str
    pending: bool
    chosen: str
    external_tokens: int
    children: tuple[dict[str, Any], ...]

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> "Decision":
        """Reads the lookup's JSON answer."""
        return cls(
            decision_id=str(v.get("decision_id", "")),
            pending=bool(v.get("pending", False)),
            chosen=str(v.get("chosen", "")),
            external_tokens=int(v.get("external_tokens", 0) or 0),
            children=tuple(v.get("children") or ()),
        )

    def child(self, name: str) -> Optional[dict[str, Any]]:
        """The named child's answer, if it answered."""
        for c in self.children:
            if c.get("name") == name:
                return c
        return None


def lookup_request(engine_id: str, request_id: str, model: str, block_hashes: list[str],
                   num_tokens: int, num_computed_tokens: int, tenant: str = "",
                   kv_transfer_params: Optional[dict[str, Any]] = None,
                   engine_version: str = "") -> dict[str, Any]:
    """The body of ``POST /v1/lookup``."""
    out: dict[str, Any] = {
        "engine_id": engine_id,
        "request_id": request_id,
        "model": model,
        "block_hashes": block_hashes,
        "num_tokens": num_tokens,
        "num_computed_tokens": num_computed_tokens,
    }
    if tenant:
        out["tenant"] = tenant
    if engine_version:
        out["engine_version"] = engine_version
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out
