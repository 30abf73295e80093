"""What the scheduler side tells the workers each step, and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._vllm import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockWrite:
    """A block the step's forward pass writes into: its record holds
    nothing from before the forward pass on, and once the pass is done it
    records ``hash_hex`` — the chunk the step completes in it — or stays
    empty when ``hash_hex`` is "" (a chunk not complete yet). With
    ``adopt`` another connector filled the block, which the forward pass
    does not write."""

    request_id: str
    group: int
    block: int
    hash_hex: str
    adopt: bool = False


@dataclass(frozen=True)
class PendingLoad:
    """A kvmesh load issued this step: the blocks the gpuworker will write."""

    request_id: str
    blocks: tuple[tuple[int, int], ...]


@dataclass
class KVMeshConnectorMetadata(KVConnectorMetadata):
    """One step's metadata, from the scheduler side to every worker."""

    step: int = 0
    writes: list[BlockWrite] = field(default_factory=list)
    loads: list[PendingLoad] = field(default_factory=list)
    #: Requests whose free request_finished delayed since the last step:
    #: the only ones a worker may report in finished_sending.
    delayed_frees: list[str] = field(default_factory=list)


@dataclass
class KVMeshWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler side after a step: the steps whose
    block identities it recorded, and (models of more than one KV-cache
    group) the requests whose load failed on it, reported in this step's
    finished_recving, which the scheduler side sends back to compute from
    their local prefix."""

    steps: set[int] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)

    def aggregate(self, other: "KVMeshWorkerMetadata") -> "KVMeshWorkerMetadata":
        """Every worker's steps and failed loads (the unions)."""
        return KVMeshWorkerMetadata(self.steps | other.steps, self.failed_loads | other.failed_loads)
