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

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

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
