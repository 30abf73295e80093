"""The connector's settings: vLLM's ``kv_connector_extra_config``.

Every setting is a key of ``kv_connector_extra_config`` (see the README's
``--kv-transfer-config`` example); the Kafka and TLS settings also read
kvmesh's own environment variables (``KVMESH_KAFKA_*``), so a connector
beside the services can share their configuration. A missing or invalid
setting raises :class:`~kvmesh_vllm.errors.KVMeshConfigError` naming it,
when vLLM builds the connector.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .errors import KVMeshConfigError

#: The prefix of every extra-config key.
PREFIX = "kvmesh."

_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_ENGINE_VERSION = re.compile(r"^[A-Za-z0-9._+-]{0,64}$")


def valid_engine_version(v: str) -> bool:
    """Whether ``v`` is an engine version kvmesh accepts
    (kvcore.ValidateEngineVersion); empty states none."""
    return bool(_ENGINE_VERSION.match(v))


def vllm_version() -> str:
    """vLLM's ``__version__``, the version the connector states, or "" when
    vLLM is not importable or its version is not one kvmesh accepts."""
    try:
        from vllm import __version__ as v  # noqa: PLC0415 (vLLM is optional here)
    except Exception:  # pragma: no cover - depends on the install
        return ""
    v = str(v)
    return v if valid_engine_version(v) else ""


def valid_tenant(t: str) -> bool:
    """Whether ``t`` is a tenant kvmesh accepts (kvcore.ValidateTenant)."""
    return bool(_TENANT.match(t))


@dataclass(frozen=True)
class Settings:
    """Everything the connector needs to reach its mesh."""

    engine_id: str
    model: str
    lookup_url: str
    kafka: dict[str, Any]
    token: str = ""
    gpuworker_urls: tuple[str, ...] = ()
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    tenant: str = ""
    #: The engine's version, stated on every lookup and ``admitted`` event:
    #: a mesh whose model spec pins another refuses them (the store's
    #: blocks are that version's). Default vLLM's ``__version__``.
    engine_version: str = ""
    role: str = "kv_both"
    lookup_timeout_s: float = 5.0
    lookup_deadline_s: float = 30.0
    publish_timeout_s: float = 30.0
    finish_timeout_s: float = 120.0
    load_timeout_s: float = 120.0
    start_deadline_s: float = 60.0
    #: Send the prompt's token ids (complete hash blocks) and LoRA adapter
    #: name with each request's ``admitted`` event, so kvmesh's BlockStored
    #: events carry them for token-keyed routers (llm-d's indexer).
    send_token_ids: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def consumer(self) -> bool:
        """A kv_consumer engine never saves."""
        return self.role == "kv_consumer"

    def gpuworker_url(self, rank_index: int) -> str:
        """The gpuworker URL of worker rank ``rank_index`` (tp + tp_size·pp)."""
        if not self.gpuworker_urls:
            raise KVMeshConfigError(f"{PREFIX}gpuworker_urls is not set: one gpuworker URL per worker rank")
        if rank_index >= len(self.gpuworker_urls):
            raise KVMeshConfigError(
                f"{PREFIX}gpuworker_urls lists {len(self.gpuworker_urls)} gpuworkers, "
                f"worker rank {rank_index} has none (one URL per rank, in rank order)"
            )
        return self.gpuworker_urls[rank_index]


def _read_secret(extra: Mapping[str, Any], env: Mapping[str, str], key: str, env_name: str) -> str:
    """A secret from ``key``, ``key_file``, ``env_name`` or ``env_name_FILE``."""
    value, path = extra.get(PREFIX + key), extra.get(PREFIX + key + "_file")
    if value and path:
        raise KVMeshConfigError(f"set {PREFIX}{key} or {PREFIX}{key}_file, not both")
    if not value and not path:
        value, path = env.get(env_name), env.get(env_name + "_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise KVMeshConfigError(f"{PREFIX}{key}_file {path!r}: {e.strerror}") from e
    return str(value or "").strip()


def _urls(v: Any, name: str) -> tuple[str, ...]:
    if v is None or v == "":
        return ()
    items = v.split(",") if isinstance(v, str) else list(v)
    out = tuple(str(u).strip().rstrip("/") for u in items if str(u).strip())
    for u in out:
        if not u.startswith(("http://", "https://")):
            raise KVMeshConfigError(f"{name}: {u!r} is not an http:// or https:// URL")
    return out


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    v = extra.get(PREFIX + key, default)
    try:
        f = float(v)
    except (TypeError, ValueError) as e:
        raise KVMeshConfigError(f"{PREFIX}{key}: {v!r} is not a number of seconds") from e
    if f <= 0:
        raise KVMeshConfigError(f"{PREFIX}{key}: {f} must be positive")
    return f


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    v = extra.get(PREFIX + key, default)
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("true", "1", "yes", "on"):
        return True
    if s in ("false", "0", "no", "off"):
        return False
    raise KVMeshConfigError(f"{PREFIX}{key}: {v!r} is not true or false")


def load(extra: Mapping[str, Any], engine_id: str = "", role: str = "kv_both",
         env: Mapping[str, str] = os.environ, served_model: str = "") -> Settings:
    """Reads the settings from vLLM's ``kv_connector_extra_config``.

    ``engine_id`` is vLLM's ``kv_transfer_config.engine_id``, used when
    ``kvmesh.engine_id`` is not set; ``role`` its ``kv_role``;
    ``served_model`` vLLM's served model name, the model the engine
    declares to the mesh when ``kvmesh.model`` is not set.
    """
    from . import transport  # the Kafka settings are transport's

    unknown = sorted(k for k in extra if k.startswith(PREFIX) and k[len(PREFIX):] not in _KNOWN)
    if unknown:
        raise KVMeshConfigError(f"unknown settings {', '.join(unknown)} (known: {', '.join(PREFIX + k for k in sorted(_KNOWN))})")
    eid = str(extra.get(PREFIX + "engine_id") or engine_id or "").strip()
    if not eid:
        raise KVMeshConfigError(f"{PREFIX}engine_id is not set (nor vLLM's kv_transfer_config.engine_id): the id of this engine's gpuworkers (KVMESH_ENGINE_ID)")
    model = str(extra.get(PREFIX + "model") or served_model or "").strip()
    if not model:
        raise KVMeshConfigError(f"{PREFIX}model is not set (nor vLLM's served model name): the name of this engine's model, one the mesh serves (KVMESH_MODEL or KVMESH_MODELS)")
    lookup = _urls(extra.get(PREFIX + "lookup_url"), PREFIX + "lookup_url")
    if len(lookup) != 1:
        raise KVMeshConfigError(f"{PREFIX}lookup_url must be one http(s) URL of the lookup service")
    tenant = str(extra.get(PREFIX + "tenant") or "")
    if tenant and not valid_tenant(tenant):
        raise KVMeshConfigError(f"{PREFIX}tenant {tenant!r}: 1 to 64 bytes of [A-Za-z0-9._-]")
    engine_version = str(extra[PREFIX + "engine_version"]) if PREFIX + "engine_version" in extra else vllm_version()
    if not valid_engine_version(engine_version):
        raise KVMeshConfigError(f"{PREFIX}engine_version {engine_version!r}: at most 64 bytes of [A-Za-z0-9._+-]")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise KVMeshConfigError(f"kv_role {role!r}: want kv_producer, kv_consumer or kv_both")
    kafka_env = dict(env)
    for k in ("brokers", "tls", "ca_file", "cert_file", "key_file", "sasl_mechanism", "sasl_username", "sasl_password", "sasl_password_file"):
        if PREFIX + "kafka_" + k in extra:
            kafka_env["KVMESH_KAFKA_" + k.upper()] = str(extra[PREFIX + "kafka_" + k])
    try:
        kafka = transport.kafka_config_from_env(kafka_env)
    except transport.ConfigError as e:
        raise KVMeshConfigError(str(e)) from e
    return Settings(
        engine_id=eid,
        model=model,
        lookup_url=lookup[0],
        kafka=kafka,
        token=_read_secret(extra, env, "token", "KVMESH_ENGINE_TOKEN"),
        gpuworker_urls=_urls(extra.get(PREFIX + "gpuworker_urls"), PREFIX + "gpuworker_urls"),
        ca_file=extra.get(PREFIX + "ca_file") or env.get("KVMESH_HTTP_CA_FILE") or None,
        cert_file=extra.get(PREFIX + "cert_file") or env.get("KVMESH_HTTP_CLIENT_CERT_FILE") or None,
        key_file=extra.get(PREFIX + "key_file") or env.get("KVMESH_HTTP_CLIENT_KEY_FILE") or None,
        tenant=tenant,
        engine_version=engine_version,
        role=role,
        lookup_timeout_s=_seconds(extra, "lookup_timeout_s", 5.0),
        lookup_deadline_s=_seconds(extra, "lookup_deadline_s", 30.0),
        publish_timeout_s=_seconds(extra, "publish_timeout_s", 30.0),
        finish_timeout_s=_seconds(extra, "finish_timeout_s", 120.0),
        load_timeout_s=_seconds(extra, "load_timeout_s", 120.0),
        start_deadline_s=_seconds(extra, "start_deadline_s", 60.0),
        send_token_ids=_bool(extra, "send_token_ids", True),
        extra=dict(extra),
    )


_KNOWN = {
    "engine_id", "model", "lookup_url", "gpuworker_urls", "token", "token_file", "tenant", "engine_version",
    "ca_file", "cert_file", "key_file",
    "lookup_timeout_s", "lookup_deadline_s", "publish_timeout_s", "finish_timeout_s", "load_timeout_s", "start_deadline_s",
    "send_token_ids",
    "kafka_brokers", "kafka_tls", "kafka_ca_file", "kafka_cert_file", "kafka_key_file",
    "kafka_sasl_mechanism", "kafka_sasl_username", "kafka_sasl_password", "kafka_sasl_password_file",
}


def served_model_name(vllm_config: Any) -> str:
    """vLLM's served model name of ``vllm_config`` (the first when it
    serves several names), or "" when it has none."""
    name = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or "")
