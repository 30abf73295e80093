"""The connector's errors: each names what the user must change.

Every error a misconfiguration can cause is raised when vLLM builds the
connector (or registers its KV caches), never from the cache path of a
running engine: a failed lookup, publish, load or save is reported and
counted, and the engine goes on.
"""


class KVMeshError(Exception):
    """Base of every error the connector raises."""


class KVMeshConfigError(KVMeshError):
    """A ``kv_connector_extra_config`` setting is missing or invalid."""


class ModelMismatchError(KVMeshError):
    """vLLM's model or KV layout does not match the mesh's."""


class UnsupportedLayoutError(KVMeshError):
    """A parallel layout or KV-cache layout this connector cannot serve."""


class MeshUnreachableError(KVMeshError):
    """A kvmesh service could not be reached at start."""
