"""Transport to kvmesh: HTTP to its services and Kafka to its topics.

Everything that crosses the wire from the vLLM connector goes through here:

* :class:`HTTPClient` calls kvmesh's HTTP services (JSON bodies, RFC 9457
  problem+json errors, bearer tokens, HTTPS with a private CA and an optional
  client certificate), retrying transient failures with exponential backoff
  and jitter until a deadline.
* :func:`kafka_config` / :func:`kafka_config_from_env` build a
  ``confluent_kafka`` configuration that mirrors kvmesh's own Kafka security
  settings (``KVMESH_KAFKA_*``, see ``pkg/bus/security.go`` and
  ``docs/security.md``), refusing the same inconsistent combinations.
* :class:`StepProducer` publishes engine records (idempotent, ``acks=all``,
  order kept per partition, keys partitioned like kvmesh's Go producers).
* :class:`TopicConsumer` reads a topic from "now" without a consumer group.

All errors derive from :class:`TransportError`. Secrets (the bearer token, the
SASL password) never appear in an exception message or a ``repr``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional, Union

from .errors import KVMeshConfigError, KVMeshError

__all__ = [
    "BACKOFF_CAP",
    "BACKOFF_START",
    "DEFAULT_BROKERS",
    "STEPS_TOPIC",
    "ConfigError",
    "HTTPClient",
    "ProblemError",
    "PublishError",
    "StepProducer",
    "TopicConsumer",
    "TransportError",
    "UnreachableError",
    "kafka_config",
    "kafka_config_from_env",
]

#: First retry delay of :class:`HTTPClient`, in seconds.
BACKOFF_START = 0.05
#: Largest retry delay of :class:`HTTPClient`, in seconds.
BACKOFF_CAP = 2.0
#: HTTP statuses that are retried (the service is overloaded or restarting).
RETRY_STATUSES = frozenset({429, 502, 503, 504})
#: How many bytes of a non-JSON error body a :class:`ProblemError` keeps.
BODY_EXCERPT = 512
#: The topic engines publish their step records to (pkg/contract).
STEPS_TOPIC = "kvmesh.engine.steps"
#: kvmesh's default bootstrap broker (pkg/contract BrokerAddr).
DEFAULT_BROKERS = "127.0.0.1:9092"
#: The SASL mechanisms kvmesh knows, by their kvmesh spelling, with their
#: Kafka names (None for no SASL).
SASL_MECHANISMS: Mapping[str, Optional[str]] = {
    "none": None,
    "plain": "PLAIN",
    "scram-sha-256": "SCRAM-SHA-256",
    "scram-sha-512": "SCRAM-SHA-512",
}
#: How many undecodable records a :class:`TopicConsumer` keeps aside.
BAD_RECORDS_KEPT = 100
#: What replaces a secret in text that would otherwise show it.
MASK = "***"
#: The logger librdkafka's own log lines go to (instead of stderr).
KAFKA_LOGGER = "kvmesh_vllm.kafka"

Token = Union[str, Callable[[], Optional[str]], None]


# --------------------------------------------------------------------------
# Errors


class TransportError(KVMeshError):
    """Base of every error this module raises (a KVMeshError)."""


class ConfigError(TransportError, KVMeshConfigError, ValueError):
    """Settings that do not fit together; the message names the setting."""


class ProblemError(TransportError):
    """A kvmesh service answered with an error (RFC 9457 problem details).

    ``status`` is the HTTP status; ``title``, ``detail``, ``type`` and
    ``field`` are the problem's members (``field`` names the request field at
    fault when the service says so); ``instance`` is the request path the
    service reports; ``extras`` holds the other members. A non-JSON error
    body is kept (its first 512 bytes) as ``detail``.
    """

    def __init__(
        self,
        status: int,
        title: str = "",
        detail: str = "",
        type: str = "about:blank",  # noqa: A002 - the RFC 9457 member name
        field: Optional[str] = None,
        instance: Optional[str] = None,
        extras: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.type = type
        self.field = field
        self.instance = instance
        self.extras: dict[str, Any] = dict(extras or {})
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"HTTP {self.status}"
        if self.title:
            text += f" {self.title}"
        if self.detail:
            text += f": {self.detail}"
        if self.field:
            text += f" (field {self.field!r})"
        if self.instance:
            text += f" [{self.instance}]"
        return text

    def __repr__(self) -> str:
        return (
            f"ProblemError(status={self.status!r}, title={self.title!r}, detail={self.detail!r}, "
            f"type={self.type!r}, field={self.field!r})"
        )

    @classmethod
    def from_response(cls, status: int, content_type: str, body: bytes) -> "ProblemError":
        """Decode an error answer: problem+json when it parses, else a body excerpt."""
        if _is_json(content_type) or body[:1] == b"{":
            try:
                doc = json.loads(body.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                doc = None
            if isinstance(doc, dict):
                known = ("type", "title", "status", "detail", "instance", "field")
                extras = {k: v for k, v in doc.items() if k not in known}
                field = doc.get("field")
                if field is None and isinstance(doc.get("parameter"), str):
                    field = doc["parameter"]
                st = doc.get("status")
                return cls(
                    status=st if isinstance(st, int) and st else status,
                    title=str(doc.get("title") or ""),
                    detail=str(doc.get("detail") or ""),
                    type=str(doc.get("type") or "about:blank"),
                    field=str(field) if field is not None else None,
                    instance=str(doc["instance"]) if doc.get("instance") else None,
                    extras=extras,
                )
        excerpt = body[:BODY_EXCERPT].decode("utf-8", errors="replace")
        return cls(status=status, title=http.client.responses.get(status, ""), detail=excerpt)


class UnreachableError(TransportError):
    """A service could not be reached (or kept answering a retryable status)
    until the retry deadline passed. ``url`` is what was called (without its
    query); ``cause`` is the last failure; ``attempts`` how many were made."""

    def __init__(self, url: str, cause: BaseException | str, attempts: int = 0, elapsed: float = 0.0) -> None:
        self.url = url
        self.cause = cause
        self.attempts = attempts
        self.elapsed = elapsed
        super().__init__(
            f"{url} unreachable: gave up after {attempts} attempt(s) in {elapsed:.2f}s: {_describe(cause)}"
        )

    def __repr__(self) -> str:
        return f"UnreachableError(url={self.url!r}, attempts={self.attempts!r}, cause={_describe(self.cause)!r})"


class PublishError(TransportError):
    """A record was not acknowledged by the broker. ``kafka_error`` is the
    broker's (or librdkafka's) error when there is one; ``delivered_unknown``
    is True when the record may still land (it was sent but not
    acknowledged in time), False when it was certainly not written."""

    def __init__(self, message: str, kafka_error: Any = None, delivered_unknown: bool = False) -> None:
        self.kafka_error = kafka_error
        self.delivered_unknown = delivered_unknown
        super().__init__(message)


def _describe(cause: BaseException | str) -> str:
    if isinstance(cause, BaseException):
        text = str(cause)
        return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
    return str(cause)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


# --------------------------------------------------------------------------
# HTTP


class HTTPClient:
    """A client of one kvmesh HTTP service.

    ``base_url`` is ``http://host:port[/prefix]`` or ``https://...``;
    ``token`` a bearer token, or a zero-argument callable returning one
    (called for every attempt, so it may refresh); None or "" sends no
    Authorization header. With https, ``ca_file`` is the CA bundle the
    server is verified against (system roots when None) and
    ``cert_file``/``key_file`` a client certificate for services that
    require mutual TLS. ``timeout`` bounds each attempt (connect and each
    read); ``retry_deadline`` bounds the whole call including retries.

    Connection errors, timeouts and 429/502/503/504 answers are retried with
    exponential backoff (50 ms doubling to 2 s, with jitter) until
    ``retry_deadline``, then :class:`UnreachableError`; a retry may resend a
    POST the service already acted on, so the calls made through it should
    be idempotent (kvmesh's engine routes are). Other error statuses raise
    :class:`ProblemError` at once. Each thread keeps its own keep-alive
    connection, so the client may be shared between threads.
    """

    def __init__(
        self,
        base_url: str,
        token: Token = None,
        ca_file: Optional[str] = None,
        cert_file: Optional[str] = None,
        key_file: Optional[str] = None,
        timeout: float = 10.0,
        retry_deadline: float = 60.0,
    ) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"base_url {base_url!r} is not an http:// or https:// URL with a host")
        if parsed.username or parsed.password:
            raise ConfigError("base_url must not carry credentials; pass token")
        if parsed.query or parsed.fragment:
            raise ConfigError(f"base_url {base_url!r} must not have a query or fragment")
        if parsed.scheme == "http":
            for name, value in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
                if value:
                    raise ConfigError(f"{name} is set but base_url {base_url!r} is not https")
        if bool(cert_file) != bool(key_file):
            raise ConfigError("cert_file needs key_file" if cert_file else "key_file needs cert_file")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout!r}")
        if retry_deadline < 0:
            raise ConfigError(f"retry_deadline must not be negative, got {retry_deadline!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.retry_deadline = float(retry_deadline)
        self._scheme = parsed.scheme
        self._host = parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._prefix = parsed.path.rstrip("/")
        self._token = token
        self._ssl: Optional[ssl.SSLContext] = None
        if parsed.scheme == "https":
            try:
                ctx = ssl.create_default_context(cafile=ca_file)
                if cert_file:
                    ctx.load_cert_chain(cert_file, key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"ca_file, cert_file or key_file cannot be loaded: {exc}") from None
            self._ssl = ctx
        self._local = threading.local()
        self._lock = threading.Lock()
        self._conns: list[http.client.HTTPConnection] = []
        self._closed = False

    def __repr__(self) -> str:
        return f"HTTPClient({self.base_url!r}, token={'set' if self._token else None})"

    def __enter__(self) -> "HTTPClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every thread's keep-alive connection; later calls open new ones."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    # -- public calls

    def post_json(self, path: str, body: Any) -> Any:
        """POST ``body`` as JSON to ``path`` and return the decoded answer."""
        return self.request("POST", path, json_body=body)[2]

    def get_json(self, path: str, params: Optional[Mapping[str, Any]] = None) -> Any:
        """GET ``path`` (with query ``params``) and return the decoded answer."""
        return self.request("GET", path, params=params)[2]

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        body: Optional[bytes] = None,
        content_type: Optional[str] = None,
        params: Optional[Union[Mapping[str, Any], Iterable[tuple[str, Any]]]] = None,
        accept: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> tuple[int, dict[str, str], Any]:
        """Send one request, retrying transient failures, and return
        ``(status, headers, data)``: headers with lower-case names, data the
        decoded JSON of a JSON answer (None when empty), else the raw bytes.

        ``json_body`` is encoded as JSON; ``body`` is sent as is with
        ``content_type`` (application/octet-stream by default); give at most
        one. ``params`` become the query string (None values are left out).
        ``headers`` are extra request headers (a request's ``traceparent``,
        say); they cannot replace the ones this client sets (Accept,
        Content-Type, User-Agent, Authorization, Host, Content-Length).
        Raises :class:`ProblemError` for an error answer that is not retried
        and :class:`UnreachableError` once ``retry_deadline`` has passed.
        """
        if json_body is not None and body is not None:
            raise ValueError("give json_body or body, not both")
        payload: Optional[bytes] = None
        sent = _extra_headers(headers)
        sent.update({"Accept": accept or "application/json, application/problem+json", "User-Agent": "kvmesh-vllm"})
        if json_body is not None:
            payload = json.dumps(json_body, separators=(",", ":")).encode("utf-8")
            sent["Content-Type"] = content_type or "application/json"
        elif body is not None:
            payload = bytes(body)
            sent["Content-Type"] = content_type or "application/octet-stream"
        target = self._prefix + "/" + path.lstrip("/")
        shown_url = f"{self.base_url}/{path.lstrip('/')}"
        if params:
            items = params.items() if isinstance(params, Mapping) else params
            query = urllib.parse.urlencode([(k, _param(v)) for k, v in items if v is not None])
            if query:
                target += "?" + query
        start = time.monotonic()
        deadline = start + self.retry_deadline
        attempt = 0
        while True:
            attempt += 1
            token = self._current_token()
            if token:
                sent["Authorization"] = "Bearer " + token
            else:
                sent.pop("Authorization", None)
            cause: BaseException
            retry_after: Optional[float] = None
            try:
                status, resp_headers, raw = self._once(method, target, payload, sent)
            except ssl.SSLCertVerificationError as exc:  # not transient: retrying cannot help
                raise TransportError(
                    f"{shown_url}: TLS verification failed: {_scrub(exc.verify_message or str(exc), token)}"
                ) from None
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timeout, TLS, bad status line
                cause = _scrubbed(exc, token)
            else:
                if status < 400:
                    return status, resp_headers, _decode(resp_headers.get("content-type", ""), raw)
                problem = ProblemError.from_response(status, resp_headers.get("content-type", ""), raw)
                problem = _scrub_problem(problem, token)
                if status not in RETRY_STATUSES:
                    raise problem
                cause = problem
                retry_after = _retry_after(resp_headers.get("retry-after"))
            delay = min(BACKOFF_CAP, BACKOFF_START * (2 ** (attempt - 1)))
            delay = random.uniform(delay / 2, delay)  # jitter: never all clients in step
            if retry_after is not None:
                delay = max(delay, min(retry_after, BACKOFF_CAP))
            now = time.monotonic()
            if now >= deadline:
                raise UnreachableError(shown_url, cause, attempt, now - start) from None
            time.sleep(min(delay, deadline - now))  # the last attempt is made at the deadline

    # -- internals

    def _current_token(self) -> Optional[str]:
        tok = self._token
        if callable(tok):
            try:
                tok = tok()
            except Exception as exc:  # the provider's error must not leak a token either
                raise TransportError(f"token provider failed: {type(exc).__name__}") from None
        if tok is not None and not isinstance(tok, str):
            raise TransportError(f"token must be a string, got {type(tok).__name__}")
        return tok or None

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._scheme == "https":
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _once(
        self, method: str, target: str, payload: Optional[bytes], headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        conn = self._connection()
        try:
            conn.request(method, target, body=payload, headers=dict(headers))
            resp = conn.getresponse()
            raw = resp.read()
        except BaseException:
            self._drop_connection()
            raise
        resp_headers = {k.lower(): v for k, v in resp.getheaders()}
        if resp.will_close:
            self._drop_connection()
        return resp.status, resp_headers, raw


#: Headers the client sets itself (or http.client does): never taken from a caller's extra headers.
_OWN_HEADERS = frozenset({"accept", "content-type", "user-agent", "authorization", "host", "content-length"})


def _extra_headers(extra: Optional[Mapping[str, str]]) -> dict[str, str]:
    """A caller's extra request headers, less the ones the client sets."""
    return {k: v for k, v in (extra or {}).items() if k.lower() not in _OWN_HEADERS}


def _param(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _decode(content_type: str, raw: bytes) -> Any:
    if _is_json(content_type):
        if not raw.strip():
            return None
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise TransportError(f"answer is not valid JSON: {exc}") from None
    return raw


def _retry_after(value: Optional[str]) -> Optional[float]:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _scrub(text: str, secret: Optional[str]) -> str:
    if secret and secret in text:
        return text.replace(secret, MASK)
    return text


def _scrubbed(exc: BaseException, secret: Optional[str]) -> BaseException:
    """Return exc, or a TransportError with its text masked when it shows secret."""
    if secret and (secret in str(exc) or secret in repr(exc)):
        return TransportError(f"{type(exc).__name__}: {_scrub(str(exc), secret)}")
    return exc


def _scrub_problem(p: ProblemError, secret: Optional[str]) -> ProblemError:
    if not secret or secret not in (str(p) + repr(p.extras)):
        return p
    extras = {k: (_scrub(v, secret) if isinstance(v, str) else v) for k, v in p.extras.items()}
    return ProblemError(
        p.status, _scrub(p.title, secret), _scrub(p.detail, secret), _scrub(p.type, secret),
        _scrub(p.field, secret) if p.field else p.field,
        _scrub(p.instance, secret) if p.instance else p.instance, extras,
    )


# --------------------------------------------------------------------------
# Kafka configuration


def kafka_config(
    bootstrap: Union[str, Iterable[str]],
    tls: bool = False,
    ca_file: Optional[str] = None,
    cert_file: Optional[str] = None,
    key_file: Optional[str] = None,
    sasl_mechanism: Optional[str] = None,
    sasl_username: Optional[str] = None,
    sasl_password: Optional[str] = None,
) -> dict[str, Any]:
    """Return the confluent_kafka (librdkafka) settings for kvmesh's brokers.

    The arguments are kvmesh's own Kafka settings (``KVMESH_KAFKA_BROKERS``,
    ``KVMESH_KAFKA_TLS``, ``_CA_FILE``, ``_CERT_FILE``, ``_KEY_FILE``,
    ``_SASL_MECHANISM`` none|plain|scram-sha-256|scram-sha-512 matched
    without regard to case, ``_SASL_USERNAME``, ``_SASL_PASSWORD``) and are
    checked as ``pkg/bus`` Security.Validate checks them: an unknown
    mechanism, a mechanism without username or password, credentials without
    a mechanism, TLS files without ``tls``, a certificate without its key
    (or the reverse) and unreadable files raise :class:`ConfigError` naming
    the setting. The brokers' certificates are verified, host name included.
    """
    if isinstance(bootstrap, str):
        brokers = [b.strip() for b in bootstrap.split(",") if b.strip()]
    else:
        brokers = [b.strip() for b in bootstrap if b and b.strip()]
    problems: list[str] = []
    if not brokers:
        problems.append("KVMESH_KAFKA_BROKERS: at least one broker is required")
    mech = (sasl_mechanism or "").strip().lower() or "none"
    if mech not in SASL_MECHANISMS:
        problems.append(
            f"KVMESH_KAFKA_SASL_MECHANISM {sasl_mechanism!r} is not none, plain, scram-sha-256 or scram-sha-512"
        )
    elif mech == "none" and (sasl_username or sasl_password):
        problems.append(
            "KVMESH_KAFKA_SASL_USERNAME or KVMESH_KAFKA_SASL_PASSWORD is set but KVMESH_KAFKA_SASL_MECHANISM is none"
        )
    elif mech != "none":
        if not sasl_username:
            problems.append(f"KVMESH_KAFKA_SASL_MECHANISM {mech} needs KVMESH_KAFKA_SASL_USERNAME")
        if not sasl_password:
            problems.append(
                f"KVMESH_KAFKA_SASL_MECHANISM {mech} needs KVMESH_KAFKA_SASL_PASSWORD (or KVMESH_KAFKA_SASL_PASSWORD_FILE)"
            )
    files = (("KVMESH_KAFKA_CA_FILE", ca_file), ("KVMESH_KAFKA_CERT_FILE", cert_file), ("KVMESH_KAFKA_KEY_FILE", key_file))
    if not tls:
        for name, value in files:
            if value:
                problems.append(f"{name} is set but KVMESH_KAFKA_TLS is not true")
    if cert_file and not key_file:
        problems.append("KVMESH_KAFKA_CERT_FILE needs KVMESH_KAFKA_KEY_FILE")
    elif key_file and not cert_file:
        problems.append("KVMESH_KAFKA_KEY_FILE needs KVMESH_KAFKA_CERT_FILE")
    elif tls:
        for name, value in files:
            if value:
                try:
                    with open(value, "rb"):
                        pass
                except OSError as exc:
                    problems.append(f"{name} {value!r} cannot be read: {exc.strerror or exc}")
    if problems:
        raise ConfigError("; ".join(problems))

    cfg: dict[str, Any] = {"bootstrap.servers": ",".join(brokers), "client.id": "kvmesh-vllm"}
    kafka_mech = SASL_MECHANISMS[mech]
    if tls:
        cfg["security.protocol"] = "SASL_SSL" if kafka_mech else "SSL"
        cfg["ssl.endpoint.identification.algorithm"] = "https"
        if ca_file:
            cfg["ssl.ca.location"] = ca_file
        if cert_file:
            cfg["ssl.certificate.location"] = cert_file
            cfg["ssl.key.location"] = key_file
    else:
        cfg["security.protocol"] = "SASL_PLAINTEXT" if kafka_mech else "PLAINTEXT"
    if kafka_mech:
        cfg["sasl.mechanism"] = kafka_mech
        cfg["sasl.username"] = sasl_username
        cfg["sasl.password"] = sasl_password
    return cfg


def _parse_bool(name: str, raw: str) -> bool:
    """Parse raw as Go's strconv.ParseBool does."""
    if raw in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if raw in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ConfigError(f"{name}={raw!r}: want true or false")


def kafka_config_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Return :func:`kafka_config` of kvmesh's ``KVMESH_KAFKA_*`` variables.

    Reads ``KVMESH_KAFKA_BROKERS`` (comma-separated, default
    ``127.0.0.1:9092``), ``KVMESH_KAFKA_TLS``, ``KVMESH_KAFKA_CA_FILE``,
    ``KVMESH_KAFKA_CERT_FILE``, ``KVMESH_KAFKA_KEY_FILE``,
    ``KVMESH_KAFKA_SASL_MECHANISM``, ``KVMESH_KAFKA_SASL_USERNAME`` and
    ``KVMESH_KAFKA_SASL_PASSWORD`` or ``KVMESH_KAFKA_SASL_PASSWORD_FILE``
    (a file whose content, trailing newlines trimmed, is the password;
    setting both is refused), as pkg/config reads them.
    ``KVMESH_KAFKA_SERVER_NAME`` is refused: librdkafka cannot verify a
    name other than the host dialled.
    """

    def get(name: str) -> str:
        return environ.get(name, "") or ""

    brokers = environ.get("KVMESH_KAFKA_BROKERS") or DEFAULT_BROKERS
    raw_tls = get("KVMESH_KAFKA_TLS").strip()
    tls = _parse_bool("KVMESH_KAFKA_TLS", raw_tls) if raw_tls else False
    if get("KVMESH_KAFKA_SERVER_NAME"):
        raise ConfigError(
            "KVMESH_KAFKA_SERVER_NAME is not supported by the Python connector (librdkafka verifies the host "
            "dialled); list the brokers by the name in their certificates"
        )
    password = get("KVMESH_KAFKA_SASL_PASSWORD")
    pw_file = get("KVMESH_KAFKA_SASL_PASSWORD_FILE")
    if pw_file:
        if password:
            raise ConfigError(
                "KVMESH_KAFKA_SASL_PASSWORD and KVMESH_KAFKA_SASL_PASSWORD_FILE are both set; set one"
            )
        try:
            with open(pw_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(f"KVMESH_KAFKA_SASL_PASSWORD_FILE: {exc.strerror or exc}") from None
    return kafka_config(
        brokers,
        tls=tls,
        ca_file=get("KVMESH_KAFKA_CA_FILE") or None,
        cert_file=get("KVMESH_KAFKA_CERT_FILE") or None,
        key_file=get("KVMESH_KAFKA_KEY_FILE") or None,
        sasl_mechanism=get("KVMESH_KAFKA_SASL_MECHANISM") or None,
        sasl_username=get("KVMESH_KAFKA_SASL_USERNAME") or None,
        sasl_password=password or None,
    )


def _masked(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (MASK if "password" in k or "secret" in k else v) for k, v in config.items()}


def _is_auth_error(err: Any) -> bool:
    from confluent_kafka import KafkaError

    return err is not None and err.code() in (
        KafkaError._AUTHENTICATION,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError._SSL,
    )


def _err_text(err: Any) -> str:
    if err is None:
        return "no error"
    try:
        return f"{err.name()}: {err.str()}"
    except Exception:  # not a KafkaError
        return str(err)


class _ClientErrors:
    """Collects the client-wide errors librdkafka reports through error_cb."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last: Any = None
        self.auth: Any = None
        self.fatal: Any = None

    def __call__(self, err: Any) -> None:
        with self._lock:
            self.last = err
            if _is_auth_error(err):
                self.auth = err
            try:
                if err.fatal():
                    self.fatal = err
            except Exception:
                pass

    def blocking(self) -> Any:
        """The error that makes waiting pointless: fatal or authentication."""
        with self._lock:
            return self.fatal or self.auth


# --------------------------------------------------------------------------
# Producer


class StepProducer:
    """Publishes engine records to a kvmesh topic.

    ``config`` is :func:`kafka_config`'s dict (other librdkafka settings may
    be added). The producer is idempotent with ``acks=all``, so records are
    written once each and in order per partition (docs/contract.md "What the
    engine promises" 4), and keys are partitioned with the Java-compatible
    murmur2 hash, as kvmesh's Go producers do, so a key lands in the same
    partition whoever publishes it. Thread-safe.
    """

    def __init__(self, config: Mapping[str, Any], topic: str = STEPS_TOPIC) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self._errors = _ClientErrors()
        cfg = dict(config)
        cfg.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": cfg.get("linger.ms", 2),
                # a record not acknowledged within 30 s fails (librdkafka's
                # default is 5 min), so a broker outage is reported, not hidden
                "message.timeout.ms": cfg.get("message.timeout.ms", 30000),
                "partitioner": cfg.get("partitioner", "murmur2_random"),
                "error_cb": self._errors,
            }
        )
        cfg.setdefault("logger", logging.getLogger(KAFKA_LOGGER))
        self._producer = Producer(cfg)
        self._config_shown = _masked(config)
        self._closed = False

    def __repr__(self) -> str:
        return f"StepProducer(topic={self.topic!r}, bootstrap={self._config_shown.get('bootstrap.servers')!r})"

    def check(self, timeout: float = 30.0) -> None:
        """Reads the topic's metadata from the brokers: raises
        :class:`TransportError` when no broker answers within ``timeout``
        or the topic does not exist (the services create it)."""
        from confluent_kafka import KafkaException

        try:
            md = self._producer.list_topics(topic=self.topic, timeout=timeout)
        except KafkaException as e:
            raise TransportError(f"Kafka at {self._config_shown.get('bootstrap.servers')}: {_err_text(e.args[0] if e.args else e)}") from None
        t = md.topics.get(self.topic)
        if t is None or t.error is not None:
            why = _err_text(t.error) if t is not None else "not in the metadata"
            raise TransportError(f"topic {self.topic} at {self._config_shown.get('bootstrap.servers')}: {why}")

    def __enter__(self) -> "StepProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, key: str, value: bytes, headers: Optional[Mapping[str, str]] = None, timeout: float = 30.0) -> tuple[int, int]:
        """Publish one record and block until the broker acknowledges it.

        Returns ``(partition, offset)``. Raises :class:`PublishError` with the
        broker's error when the record is refused, when the client cannot
        authenticate or hit a fatal error, or when ``timeout`` seconds pass
        without an acknowledgement (``delivered_unknown`` tells whether the
        record may still land).
        """
        from confluent_kafka import KafkaError

        if self._closed:
            raise PublishError("producer is closed")
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def on_delivery(err: Any, msg: Any) -> None:
            outcome["err"] = err
            if msg is not None and err is None:
                outcome["pos"] = (msg.partition(), msg.offset())
            done.set()

        deadline = time.monotonic() + timeout
        self._produce(key, value, headers, on_delivery, deadline, "producer queue full until the timeout")
        blocking_since: Optional[float] = None
        while not done.is_set():
            self._producer.poll(0.05)
            if done.is_set():
                break
            now = time.monotonic()
            blocking = self._errors.blocking()
            if blocking is not None and blocking_since is None:
                blocking_since = now
            # an authentication or fatal error: give librdkafka a moment to
            # report the record itself, then stop waiting
            if now >= deadline or (blocking_since is not None and now - blocking_since > 1.0):
                self._producer.purge(in_queue=True, in_flight=False, blocking=False)
                end = time.monotonic() + 1.0
                while not done.is_set() and time.monotonic() < end:
                    self._producer.poll(0.05)
                if "pos" in outcome:
                    return outcome["pos"]
                err = outcome.get("err")
                purged = err is not None and err.code() == KafkaError._PURGE_QUEUE
                reason = blocking if blocking is not None else (err if not purged else None)
                what = _err_text(reason) if reason is not None else f"no acknowledgement within {timeout:g}s"
                raise PublishError(
                    f"publish to {self.topic}: {what}", reason, delivered_unknown=not purged
                )
        err = outcome.get("err")
        if err is not None:
            raise PublishError(f"publish to {self.topic}: {_err_text(err)}", err)
        return outcome["pos"]

    def publish_async(self, key: str, value: bytes, on_done: Callable[[Optional[PublishError]], None],
                      headers: Optional[Mapping[str, str]] = None) -> None:
        """Queue one record without waiting; ``on_done`` is called from a
        later :meth:`poll` (or :meth:`flush`) with None once the broker
        acknowledged it, or with the :class:`PublishError`. The idempotent
        producer keeps the records of one key in the order queued.
        Raises :class:`PublishError` when the record cannot be queued (the
        producer is closed, or its local queue stays full for 5 s)."""
        if self._closed:
            raise PublishError("producer is closed")

        def on_delivery(err: Any, msg: Any) -> None:
            on_done(None if err is None else PublishError(f"publish to {self.topic}: {_err_text(err)}", err))

        self._produce(key, value, headers, on_delivery, time.monotonic() + 5.0, "producer queue full for 5 s")

    def _produce(self, key: str, value: bytes, headers: Optional[Mapping[str, str]], on_delivery: Callable[[Any, Any], None],
                 deadline: float, full: str) -> None:
        """Queues one record, serving delivery reports while librdkafka's
        local queue is full until ``deadline`` (then PublishError ``full``)."""
        from confluent_kafka import KafkaException

        hdrs = [(k, v.encode("utf-8")) for k, v in (headers or {}).items()]
        while True:
            try:
                self._producer.produce(self.topic, value=value, key=key.encode("utf-8"), headers=hdrs, on_delivery=on_delivery)
                return
            except BufferError:  # local queue full: serve delivery reports and try again
                if time.monotonic() >= deadline:
                    raise PublishError(full) from None
                self._producer.poll(0.05)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                raise PublishError(f"publish to {self.topic}: {_err_text(err)}", err) from None

    def poll(self) -> int:
        """Serves the delivery reports that arrived (publish_async's
        callbacks) without waiting; returns how many."""
        return self._producer.poll(0)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait up to ``timeout`` seconds for queued records; return how many remain."""
        return self._producer.flush(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Flush the queued records (up to ``timeout`` seconds) and stop."""
        if self._closed:
            return
        self._closed = True
        self._producer.flush(timeout)


# --------------------------------------------------------------------------
# Consumer


class TopicConsumer:
    """Reads a topic from "now", without a consumer group.

    :meth:`start` reads the topic's partitions and their high watermarks
    and assigns each partition at its high watermark: every record
    published after ``start()`` returns is read, none published before. A
    background thread polls. Records whose key is not ``key`` (when set) are
    skipped; each value is decoded as a JSON object, with ``_headers``
    (name to value), ``_offset``, ``_partition`` and ``_key`` added.
    Values that do not decode are counted in :attr:`bad_records` and kept
    in :attr:`bad` (with the error), never raised. Thread-safe; usable as a
    context manager (start on enter, close on exit).
    """

    def __init__(self, config: Mapping[str, Any], topic: str, key: Optional[str] = None) -> None:
        self.topic = topic
        self.key = key
        self._config = dict(config)
        self._cond = threading.Condition()
        self._pending: list[dict[str, Any]] = []
        self._bad: list[tuple[int, int, Optional[bytes], bytes, str]] = []
        self._bad_count = 0
        self._errors = _ClientErrors()
        self._consume_errors: list[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._consumer: Any = None

    def __repr__(self) -> str:
        return f"TopicConsumer(topic={self.topic!r}, key={self.key!r}, started={self._thread is not None})"

    def __enter__(self) -> "TopicConsumer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout: float = 30.0) -> "TopicConsumer":
        """Assign every partition at its high watermark and start polling.

        Raises :class:`TransportError` (naming the broker's error, such as a
        failed authentication) when the topic's metadata or watermarks cannot
        be read within ``timeout`` seconds. Calling it again does nothing.
        """
        from confluent_kafka import Consumer, KafkaException, TopicPartition

        if self._thread is not None:
            return self
        cfg = dict(self._config)
        cfg.update(
            {
                # librdkafka wants a group id; it is never joined (assign
                # only) and never committed to.
                "group.id": cfg.get("group.id", f"kvmesh-vllm-reader-{uuid.uuid4().hex}"),
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "error_cb": self._errors,
            }
        )
        cfg.setdefault("logger", logging.getLogger(KAFKA_LOGGER))
        consumer = Consumer(cfg)
        deadline = time.monotonic() + timeout
        try:
            assignment = []
            partitions = self._partitions(consumer, deadline)
            for p in partitions:
                tp = TopicPartition(self.topic, p)
                left = max(0.1, deadline - time.monotonic())
                _, high = consumer.get_watermark_offsets(tp, timeout=left, cached=False)
                assignment.append(TopicPartition(self.topic, p, high))
            consumer.assign(assignment)
        except KafkaException as exc:
            consumer.close()
            err = self._errors.blocking() or (exc.args[0] if exc.args else None)
            raise TransportError(f"read {self.topic} partitions: {_err_text(err)}") from None
        except BaseException:
            consumer.close()
            raise
        self._consumer = consumer
        self._thread = threading.Thread(target=self._run, name=f"kvmesh-consumer-{self.topic}", daemon=True)
        self._thread.start()
        return self

    def _partitions(self, consumer: Any, deadline: float) -> list[int]:
        from confluent_kafka import KafkaException

        last: Any = None
        while True:
            consumer.poll(0)  # serves error_cb: an authentication failure shows there
            left = deadline - time.monotonic()
            blocking = self._errors.blocking()
            if left <= 0 or blocking is not None:
                err = blocking or last or self._errors.last
                raise TransportError(f"read {self.topic} metadata: {_err_text(err)}")
            try:
                md = consumer.list_topics(self.topic, timeout=min(left, 2.0))
            except KafkaException as exc:
                last = exc.args[0] if exc.args else None
                continue
            topic = md.topics.get(self.topic)
            if topic is None:
                continue
            if topic.error is not None:
                last = topic.error
                if _is_auth_error(topic.error):
                    raise TransportError(f"read {self.topic} metadata: {_err_text(topic.error)}")
                continue
            if topic.partitions:
                return sorted(topic.partitions)

    def _run(self) -> None:
        from confluent_kafka import KafkaError

        consumer = self._consumer
        try:
            while not self._stop.is_set():
                msg = consumer.poll(0.1)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        with self._cond:
                            self._consume_errors.append(_err_text(err))
                            del self._consume_errors[:-BAD_RECORDS_KEPT]
                    continue
                raw_key = msg.key()
                if self.key is not None and raw_key != self.key.encode("utf-8"):
                    continue
                try:
                    self._accept(msg, raw_key)
                except Exception as exc:  # keep polling whatever one record does
                    with self._cond:
                        self._consume_errors.append(f"offset {msg.offset()}: {type(exc).__name__}: {exc}")
                        del self._consume_errors[:-BAD_RECORDS_KEPT]
        finally:
            consumer.close()

    def _accept(self, msg: Any, raw_key: Optional[bytes]) -> None:
        value = msg.value() or b""
        try:
            doc = json.loads(value.decode("utf-8"))
            if not isinstance(doc, dict):
                raise ValueError(f"value is a JSON {type(doc).__name__}, not an object")
        except (UnicodeDecodeError, ValueError) as exc:
            with self._cond:
                self._bad_count += 1
                self._bad.append((msg.partition(), msg.offset(), raw_key, value, str(exc)))
                del self._bad[:-BAD_RECORDS_KEPT]
                self._cond.notify_all()
            return
        doc["_headers"] = {k: (v.decode("utf-8", errors="replace") if v is not None else "") for k, v in (msg.headers() or [])}
        doc["_offset"] = msg.offset()
        doc["_partition"] = msg.partition()
        doc["_key"] = raw_key.decode("utf-8", errors="replace") if raw_key is not None else None
        with self._cond:
            self._pending.append(doc)
            self._cond.notify_all()

    @property
    def bad_records(self) -> int:
        """How many records' values could not be decoded as a JSON object."""
        with self._cond:
            return self._bad_count

    @property
    def bad(self) -> list[tuple[int, int, Optional[bytes], bytes, str]]:
        """The last undecodable records: (partition, offset, key, value, error)."""
        with self._cond:
            return list(self._bad)

    @property
    def errors(self) -> list[str]:
        """The consume errors the poll thread met (most recent last)."""
        with self._cond:
            errs = list(self._consume_errors)
        if self._errors.last is not None:
            errs.append(_err_text(self._errors.last))
        return errs

    def drain(self) -> list[dict[str, Any]]:
        """Return (and forget) the records received since the last drain, in arrival order."""
        with self._cond:
            out, self._pending = self._pending, []
            return out

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout: float) -> Optional[dict[str, Any]]:
        """Wait up to ``timeout`` seconds for an undrained record that
        satisfies ``predicate`` and return it (it stays for :meth:`drain`);
        None when none came in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for doc in self._pending:
                    if predicate(doc):
                        return doc
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the poll thread and close the consumer."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
