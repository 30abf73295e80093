"""Reusable pytest fixtures for the transport tests: the real ``kvmesh
devbroker`` (plain, and TLS + SASL SCRAM-SHA-512), a CA and certificates made
with the ``openssl`` CLI, and a scripted HTTP(S) server in a thread.

Import the fixtures by name into a test module::

    from fixtures_transport import kvmesh_bin, devbroker, certs, secure_devbroker, mtls_devbroker, http_server
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

#: The repository root (connectors/vllm/tests -> repo).
REPO_ROOT = Path(__file__).resolve().parents[3]
#: How long a broker may take to log "broker ready".
BROKER_READY_TIMEOUT = 30.0
#: SCRAM user the secure broker accepts.
SASL_USER = "vllm-engine"
#: Its password.
SASL_PASSWORD = "s3cret-Pa55word"


def find_go() -> str:
    """Return the go tool: on PATH, else /usr/local/go/bin/go."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        pytest.skip("no Go toolchain to build kvmesh and KVMESH_BIN is unset")
    return go


@pytest.fixture(scope="session")
def kvmesh_bin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The kvmesh binary: $KVMESH_BIN, else built from the repository."""
    given = os.environ.get("KVMESH_BIN")
    if given:
        assert os.access(given, os.X_OK), f"KVMESH_BIN={given} is not an executable"
        return given
    out = tmp_path_factory.mktemp("kvmesh-bin") / "kvmesh"
    res = subprocess.run(
        [find_go(), "build", "-o", str(out), "./cmd/kvmesh"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, f"go build ./cmd/kvmesh failed:\n{res.stderr}"
    return str(out)


@dataclass
class BrokerProcess:
    """A running ``kvmesh devbroker``: its address and its log."""

    proc: subprocess.Popen
    addr: str
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)

    def log(self) -> str:
        """The broker's stderr so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_broker(
    binary: str, workdir: Path, args: Optional[list[str]] = None, env: Optional[dict[str, str]] = None,
    timeout: float = BROKER_READY_TIMEOUT,
) -> BrokerProcess:
    """Start ``kvmesh devbroker -addr 127.0.0.1:0`` and poll its log for
    the "broker ready" line (whose ``addr`` is the address), failing with
    the log when it exits or is not ready within ``timeout`` seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "devbroker.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_BROKER_")}
    full_env.update(env or {})
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [binary, "devbroker", "-addr", "127.0.0.1:0", *(args or [])],
        stdout=subprocess.DEVNULL, stderr=log, env=full_env,
    )
    log.close()
    deadline = time.monotonic() + timeout
    while True:
        for line in log_path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("msg") == "broker ready" and rec.get("addr"):
                return BrokerProcess(proc, rec["addr"], log_path, rec)
        if proc.poll() is not None:
            raise AssertionError(f"devbroker exited {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"devbroker not ready within {timeout}s:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)  # polling interval of the deadline loop above


@pytest.fixture(scope="session")
def devbroker(kvmesh_bin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A plaintext devbroker for the whole session."""
    b = start_broker(kvmesh_bin, tmp_path_factory.mktemp("devbroker"))
    yield b
    b.stop()


@dataclass
class Certs:
    """PEM files made by :func:`make_certs`: a CA, a server certificate for
    127.0.0.1 and localhost, and a client certificate, all signed by the CA."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"openssl {' '.join(args)} failed:\n{res.stderr}"


def make_certs(d: Path) -> Certs:
    """Generate a CA, a server and a client certificate (P-256) in ``d``."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI")
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "2",
                 "-subj", f"/CN=kvmesh test {ca}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    (d / "server.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    (d / "client.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    )
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=kvmesh test {name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return Certs(d, d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key",
                 d / "other-ca.crt")


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA with server and client certificates for the session."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def secure_devbroker(kvmesh_bin: str, certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A devbroker that accepts TLS only and requires SASL SCRAM-SHA-512 as
    SASL_USER / SASL_PASSWORD (given by environment, not in the process list)."""
    b = start_broker(
        kvmesh_bin, tmp_path_factory.mktemp("secure-devbroker"),
        args=["-tls-cert", str(certs.server_cert), "-tls-key", str(certs.server_key)],
        env={"KVMESH_BROKER_SASL_USERS": f"scram-sha-512:{SASL_USER}:{SASL_PASSWORD}"},
    )
    yield b
    b.stop()


@pytest.fixture(scope="session")
def mtls_devbroker(kvmesh_bin: str, certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A devbroker that accepts TLS only and requires a client certificate
    signed by the test CA (mutual TLS), without SASL."""
    b = start_broker(
        kvmesh_bin, tmp_path_factory.mktemp("mtls-devbroker"),
        args=["-tls-cert", str(certs.server_cert), "-tls-key", str(certs.server_key), "-tls-client-ca", str(certs.ca)],
    )
    yield b
    b.stop()


@dataclass
class Answer:
    """One scripted HTTP answer."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    """One request the scripted server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class ScriptedServer:
    """An HTTP(S) server in a thread answering from a script: each request
    takes the next :class:`Answer` (the last one repeats); ``echo_auth``
    puts the Authorization header into a problem detail, to check clients
    mask it. Requests are recorded in ``seen``."""

    def __init__(self, tls: Optional[ssl.SSLContext] = None) -> None:
        self.lock = threading.Lock()
        self.script: list[Answer] = [Answer(200, b"{}")]
        self.seen: list[Seen] = []
        self.echo_auth = False
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with owner.lock:
                    owner.seen.append(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    ans = owner.script.pop(0) if len(owner.script) > 1 else owner.script[0]
                    echo = owner.echo_auth
                payload = ans.body
                if echo:
                    payload = json.dumps({"type": "about:blank", "title": "Unauthorized", "status": ans.status,
                                          "detail": f"bad credentials {self.headers.get('Authorization')}"}).encode()
                self.send_response(ans.status)
                self.send_header("Content-Type", ans.content_type)
                self.send_header("Content-Length", str(len(payload)))
                for k, v in ans.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        host = "localhost" if tls is not None else "127.0.0.1"
        self.url = f"{scheme}://{host}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def answer(self, *answers: Answer) -> None:
        """Replace the script."""
        with self.lock:
            self.script = list(answers)
            self.seen.clear()

    def requests(self) -> list[Seen]:
        """The requests received since the script was last set."""
        with self.lock:
            return list(self.seen)

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def http_server() -> Iterator[ScriptedServer]:
    """A plain scripted HTTP server."""
    s = ScriptedServer()
    yield s
    s.close()


@pytest.fixture
def https_server(certs: Certs) -> Iterator[ScriptedServer]:
    """A scripted HTTPS server with the test CA's server certificate that
    requires a client certificate signed by the same CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(certs.server_cert), str(certs.server_key))
    ctx.load_verify_locations(str(certs.ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    s = ScriptedServer(tls=ctx)
    yield s
    s.close()


def problem(status: int, detail: str, field_name: Optional[str] = None, title: str = "") -> Answer:
    """A problem+json answer as kvmesh's pkg/httpserver writes one."""
    doc: dict[str, Any] = {"type": "about:blank", "title": title or http.client.responses.get(status, ""), "status": status,
                           "detail": detail, "instance": "/v1/x"}
    if field_name:
        doc["field"] = field_name
    return Answer(status, json.dumps(doc).encode(), "application/problem+json")
