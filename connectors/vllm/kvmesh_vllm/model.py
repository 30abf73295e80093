"""The KV layout the connector and the mesh must agree on.

A :class:`ModelSpec` is kvmesh's model spec (``kvmesh model --json`` prints
it under ``"model"``): the KV-cache groups in group order, each with its
kind, block size and bytes per block, and the hash block size of the
request's block-hash chain. The connector builds one from vLLM's
``KVCacheConfig`` and checks it against the mesh's (the gpuworkers' pool),
so a model served by vLLM with another layout than the mesh's is refused at
start instead of loading wrong bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .errors import ModelMismatchError, UnsupportedLayoutError

#: Kinds of KV-cache groups, as kvmesh's model spec names them.
KIND_FULL = "full_attention"
KIND_MLA = "mla"
KIND_SLIDING_WINDOW = "sliding_window"
KIND_MAMBA = "mamba"

KINDS = (KIND_FULL, KIND_MLA, KIND_SLIDING_WINDOW, KIND_MAMBA)


@dataclass(frozen=True)
class Group:
    """One KV-cache group: its kind, block size in tokens and block bytes."""

    kind: str
    block_size: int
    bytes_per_block: int
    window: int = 0

    @property
    def window_blocks(self) -> int:
        """The blocks a sliding window keeps: ceil((window - 1) / block_size),
        at least one (kvcore's ``Group.WindowBlocks``); 0 for other kinds."""
        if self.kind != KIND_SLIDING_WINDOW:
            return 0
        return max(1, -(-(self.window - 1) // self.block_size))

    def reaches(self, chunk_end: int, hit: int) -> bool:
        """Whether a resume at ``hit`` needs the chunk ending at ``chunk_end``.

        Full attention needs every earlier chunk, a sliding window the chunks
        the window reaches, Mamba only the state at the hit (kvcore's
        ``Group.Reaches``).
        """
        if chunk_end > hit:
            return False
        if self.kind == KIND_MAMBA:
            return chunk_end == hit
        if self.kind == KIND_SLIDING_WINDOW:
            return chunk_end > hit - self.window_blocks * self.block_size
        return True


@dataclass(frozen=True)
class ModelSpec:
    """A model's KV layout: its name, hash block size and groups."""

    name: str
    hash_block_size: int
    groups: tuple[Group, ...]
    parallel: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> "ModelSpec":
        """Reads kvmesh's model spec JSON (``kvmesh model --json``'s ``model``)."""
        try:
            groups = tuple(
                Group(
                    kind=str(g["kind"]),
                    block_size=int(g["block_size"]),
                    bytes_per_block=int(g["bytes_per_block"]),
                    window=int(g.get("window", 0) or 0),
                )
                for g in spec["groups"]
            )
            m = cls(
                name=str(spec["name"]),
                hash_block_size=int(spec["hash_block_size"]),
                groups=groups,
                parallel=dict(spec.get("parallel") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelMismatchError(f"model spec is malformed: {e!r}") from e
        m.validate()
        return m

    def validate(self) -> None:
        """Refuses a layout kvmesh's connector cannot serve."""
        if not self.groups:
            raise ModelMismatchError(f"model {self.name!r} has no KV-cache groups")
        if self.hash_block_size <= 0:
            raise ModelMismatchError(f"model {self.name!r}: hash_block_size {self.hash_block_size}")
        for i, g in enumerate(self.groups):
            if g.kind not in KINDS:
                raise UnsupportedLayoutError(f"group {i}: kind {g.kind!r} (want one of {', '.join(KINDS)})")
            if g.block_size <= 0 or g.bytes_per_block <= 0:
                raise ModelMismatchError(f"group {i}: block_size {g.block_size}, bytes_per_block {g.bytes_per_block}")
            if g.block_size % self.hash_block_size != 0:
                raise UnsupportedLayoutError(
                    f"group {i}: block size {g.block_size} is not a multiple of the hash block size "
                    f"{self.hash_block_size} (partial hash hits are not supported by this connector)"
                )

    @property
    def scheduler_block_size(self) -> int:
        """The least common multiple of the groups' block sizes."""
        return math.lcm(*(g.block_size for g in self.groups))

    def load_chunks(self, group: int, start: int, hit: int) -> list[int]:
        """Block indexes of the group's chunks a load resuming at ``hit``
        from ``start`` writes (kvcore's ``Model.LoadChunks``)."""
        bs = self.groups[group].block_size
        out = []
        for p in range(start // bs, hit // bs):
            if (p + 1) * bs > start and self.groups[group].reaches((p + 1) * bs, hit):
                out.append(p)
        return out


def check_same_layout(engine: ModelSpec, mesh_groups: Sequence[dict[str, Any]], where: str) -> None:
    """Refuses an engine layout that differs from the mesh's.

    ``mesh_groups`` are the groups a gpuworker serves (``GET /v1/pool``:
    ``kind``, ``bytes_per_block`` and, where present, ``block_size``).
    """
    if len(mesh_groups) != len(engine.groups):
        raise ModelMismatchError(
            f"{where}: the mesh's model has {len(mesh_groups)} KV-cache groups, vLLM's has {len(engine.groups)}"
        )
    for i, (g, mg) in enumerate(zip(engine.groups, mesh_groups)):
        want = int(mg.get("bytes_per_block", -1))
        if want != g.bytes_per_block:
            raise ModelMismatchError(
                f"{where}: group {i}: the mesh stores {want} bytes per block, vLLM's KV cache has {g.bytes_per_block}"
            )
        if "block_size" in mg and int(mg["block_size"]) != g.block_size:
            raise ModelMismatchError(
                f"{where}: group {i}: the mesh's block size is {mg['block_size']} tokens, vLLM's is {g.block_size}"
            )
        kind = str(mg.get("kind", g.kind))
        if kind != g.kind and {kind, g.kind} != {KIND_FULL, KIND_MLA}:
            raise ModelMismatchError(f"{where}: group {i}: the mesh's kind is {kind!r}, vLLM's is {g.kind!r}")
