"""vLLM general plugin: registers ``KVMeshConnector`` with vLLM's KVConnectorFactory.

The package's ``vllm.general_plugins`` entry point (``kvmesh``, see
pyproject.toml) names :func:`register`. vLLM's plugin loader
(``vllm.plugins.load_general_plugins``) calls it in every vLLM process, once
per process and possibly in several processes, so that
``--kv-transfer-config '{"kv_connector": "KVMeshConnector", ...}'`` works
without ``kv_connector_module_path``.

This module imports nothing at import time beyond the standard library: the
factory is imported when vLLM calls :func:`register` (vLLM is already loaded
by then), and the connector itself (numpy, confluent-kafka, torch) only when
vLLM first asks the factory for the class, through the factory's lazy loader.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVMeshConnector"
CONNECTOR_MODULE = "kvmesh_vllm.connector"
CONNECTOR_CLASS = "KVMeshConnector"

logger = logging.getLogger(__name__)


def register() -> None:
    """Register ``KVMeshConnector`` with vLLM's ``KVConnectorFactory``.

    Idempotent: the factory raises ``ValueError`` for a name already
    registered, so a name that is already there (an earlier call in this
    process, or a vLLM that registers it itself) is left as it is. Never
    raises: vLLM calls general plugins unguarded at engine start, and a vLLM
    that cannot take the registration (no factory, another signature) must
    still start for users who do not use kvmesh; it is logged, and
    ``kv_connector_module_path: "kvmesh_vllm.connector"`` still works.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # noqa: BLE001 - no vLLM, or one without the factory
        logger.warning(
            "kvmesh: vLLM's KVConnectorFactory is not importable; %s is not registered by name "
            "(use kv_connector_module_path=%r)",
            CONNECTOR_NAME,
            CONNECTOR_MODULE,
            exc_info=True,
        )
        return
    if _registered(KVConnectorFactory):
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:
        # Already registered (a concurrent call, or a factory whose registry
        # _registered cannot see): the name resolves either way.
        if not _registered(KVConnectorFactory):
            logger.warning("kvmesh: registering %s with vLLM failed", CONNECTOR_NAME, exc_info=True)
        return
    except Exception:  # noqa: BLE001 - a vLLM with another factory interface
        logger.warning("kvmesh: registering %s with vLLM failed", CONNECTOR_NAME, exc_info=True)
        return
    logger.debug("kvmesh: registered %s -> %s.%s", CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)


def _registered(factory: type) -> bool:
    """Whether the factory already knows the name (its registry, where it has one)."""
    registry = getattr(factory, "_registry", None)
    try:
        return registry is not None and CONNECTOR_NAME in registry
    except TypeError:
        return False
