"""vLLM's connector base classes, or stand-ins where vLLM is not installed.

The connector subclasses vLLM's own ``KVConnectorBase_V1``,
``KVConnectorMetadata``, ``KVConnectorWorkerMetadata`` and ``SupportsHMA``
when vLLM is importable, as vLLM requires of a connector it loads through
``kv_connector_module_path``. Without vLLM (kvmesh's own tests, which drive
the connector the way vLLM's scheduler and workers call it) the stand-ins
below take their place, with the same names and methods, so that the
package imports and is tested without vLLM.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any

try:  # pragma: no cover - exercised only inside vLLM
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata  # type: ignore
    except ImportError:
        class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
            """Stand-in for vLLM versions without worker metadata."""

    try:  # vLLM after 2026-08-22: per-request load failures
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults  # type: ignore
        HAVE_TRANSFER_RESULTS = True
    except ImportError:
        HAVE_TRANSFER_RESULTS = False

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = HAVE_TRANSFER_RESULTS = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """vLLM's KVConnectorRole: where a connector instance runs."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """vLLM's scheduler → worker metadata base."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """vLLM's worker → scheduler metadata base."""

        def aggregate(self, other: Any) -> Any:  # noqa: D401 - vLLM's signature
            """Merges another worker's metadata into this one."""
            raise NotImplementedError

    class SupportsHMA:  # type: ignore[no-redef]
        """vLLM's marker of connectors that support the hybrid memory allocator."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """The part of vLLM's KVConnectorBase_V1 the connector relies on."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            if self._kv_transfer_config is None:
                raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> Any:
            """Where this instance runs."""
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            """Sets the step's metadata (before the forward pass)."""
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            """Clears the step's metadata (after the forward pass)."""
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            """Whether a step's metadata is bound."""
            return self._connector_metadata is not None


if not HAVE_TRANSFER_RESULTS:
    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM's KVConnectorTransferResults (vLLM after
        2026-08-22; older vLLM never calls get_transfer_results): one
        worker's finished saves and loads, and the loads that failed
        (each also in finished_recving, as vLLM requires)."""

        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        failed_recving: set = field(default_factory=set)


@dataclass(frozen=True)
class Capabilities:
    """What the running vLLM's scheduler accepts from a connector,
    feature-detected once at start (vLLM has no version field for it;
    newer vLLM's per-request load failures need no flag: vLLM calls
    ``get_transfer_results`` where it has it, ``HAVE_TRANSFER_RESULTS``):

    ``external_mamba_hits``
        the scheduler's Mamba "align" chunk split accepts tokens a connector
        supplies; the 2026-05-27 tree asserts they are 0 ("External KV
        connector is not verified yet"), so there a hybrid Mamba model must
        be answered 0 (nothing loaded; saves go on).
    """

    external_mamba_hits: bool = True


def capabilities() -> Capabilities:
    """The running vLLM's :class:`Capabilities` (defaults without vLLM)."""
    if not HAVE_VLLM:
        return Capabilities()
    try:  # pragma: no cover - inside vLLM
        from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore
    except ImportError:  # pragma: no cover
        return Capabilities()
    split = getattr(Scheduler, "_mamba_block_aligned_split", None)
    try:
        src = inspect.getsource(split) if split is not None else ""
    except (OSError, TypeError):  # no source: assume the cautious answer
        src = "not verified yet"
    return Capabilities(external_mamba_hits="not verified yet" not in src)


def block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM's engine core
    resolves them (``resolve_kv_cache_block_sizes``: a hybrid model hashes
    every GCD of its groups' block sizes unless configured otherwise);
    without it, the cache config's block size (and hash_block_size)."""
    if HAVE_VLLM:  # pragma: no cover - inside vLLM
        try:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes  # type: ignore
        except ImportError:
            pass
        else:
            sbs, hbs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            return int(sbs), int(hbs)
    cache = getattr(vllm_config, "cache_config", None)
    bs = int(getattr(cache, "block_size", None) or 16)
    return bs, int(getattr(cache, "hash_block_size", None) or bs)
