"""``rerankit serve --ssl-certfile``: HTTPS with a certificate of a CA made for the test, the remote client trusting
that CA through $SSL_CERT_FILE, mutual TLS with ``--ssl-ca-certs``, files that do not load refused before the
model loads, sockets in their handshake counted against the connection limit, and the handshake and the first
request's headers sharing one header timeout (on the server of ``serve``, run in a thread)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402
from live_server import closed_by_server, held_until, loopback_listener, server_sockets, serving  # noqa: E402
from server_fakes import RecordingBackend  # noqa: E402
from test_cli import CHILD_ENV, DOCUMENTS, QUERY, rerankit_cli  # noqa: E402

from rerankit.server import connections  # noqa: E402
from rerankit.server.app import create_app  # noqa: E402
from rerankit.server.connections import uvicorn_config  # noqa: E402
from rerankit.server.limits import ServerConfig  # noqa: E402
from rerankit.server.shutdown import DrainingServer  # noqa: E402


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _issue(subject: str, issuer: tuple | None, ca: bool, folder: Path) -> tuple:
    """A key and certificate for ``subject``, signed by ``issuer`` (key, cert) or self-signed; both written as PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    signer_key, signer_cert = issuer if issuer else (key, None)
    builder = (x509.CertificateBuilder().subject_name(_name(subject))
               .issuer_name(signer_cert.subject if signer_cert else _name(subject))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    (folder / f"{subject}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                              serialization.PrivateFormat.PKCS8,
                                                              serialization.NoEncryption()))
    (folder / f"{subject}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca = _issue("ca", None, True, folder)
    _issue("server", ca, False, folder)
    _issue("client", ca, False, folder)
    return folder


HEADER_TIMEOUT_S = 1.0


def _served(*flags: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "rerankit", "serve", "--port", str(port), "--log-level",
                               "info", "--no-warmup", *flags], env=CHILD_ENV, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    return server, port


def _wait_ready(server: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 90
    while not ready():
        assert server.poll() is None, server.stderr.read()
        assert time.monotonic() < deadline, "rerankit serve did not come up"
        time.sleep(0.05)


def _stop(server: subprocess.Popen) -> str:
    server.send_signal(signal.SIGINT)
    server.wait(timeout=30)
    return server.stderr.read()


def _answers(url: str, **client) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1, **client).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def tls_servers(request, pki) -> dict[str, tuple[subprocess.Popen, int]]:
    """(process, port) of the ``rerankit serve`` of each selected test below, "https" (a server certificate) and
    "mutual" (``--ssl-ca-certs`` too), all started as the first of those tests sets up: each child spends ~3 s
    importing and loading the model, side by side with the other rather than one after it (2 cores)."""
    tests = {"https": test_serve_over_https_and_rank_against_it_trusting_the_ca_from_the_environment,
             "mutual": test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca}
    flags = ["--ssl-certfile", str(pki / "server.pem"), "--ssl-keyfile", str(pki / "server.key"),
             "--header-timeout", str(HEADER_TIMEOUT_S)]
    selected = {getattr(item, "function", None) for item in request.session.items}
    started = {kind: _served(*flags, *(["--ssl-ca-certs", str(pki / "ca.pem")] if kind == "mutual" else []))
               for kind, test in tests.items() if test in selected}
    yield started
    for server, _ in started.values():
        if server.poll() is None:
            _stop(server)


def test_serve_over_https_and_rank_against_it_trusting_the_ca_from_the_environment(pki, tls_servers):
    server, port = tls_servers["https"]
    url = f"https://127.0.0.1:{port}"
    try:
        _wait_ready(server, lambda: _answers(url, verify=str(pki / "ca.pem")))
        with pytest.raises(httpx.ConnectError):  # the CA is not one the system trusts
            httpx.get(f"{url}/health", timeout=5)
        with pytest.raises(httpx.TransportError):  # plain HTTP on the HTTPS port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
        # a socket that never starts its TLS handshake is closed after the header timeout (asyncio's own: 60 s)
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle.settimeout(30)
            started = time.monotonic()
            try:
                assert idle.recv(1) == b""
            except ConnectionResetError:
                pass
            assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
        remote = rerankit_cli("rank", "--model", url, "--query", QUERY, "--docs", "-", "--json",
                              stdin="\n".join(DOCUMENTS), SSL_CERT_FILE=str(pki / "ca.pem"))
        assert remote.returncode == 0, remote.stderr
        assert [hit["index"] for hit in json.loads(remote.stdout)["results"]] == [1, 3, 2, 0]
    finally:
        log = _stop(server)
    assert f"ready on https://127.0.0.1:{port}" in log


def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(pki, tls_servers):
    server, port = tls_servers["mutual"]
    url = f"https://127.0.0.1:{port}"
    with_cert = {"verify": str(pki / "ca.pem"), "cert": (str(pki / "client.pem"), str(pki / "client.key"))}
    try:
        _wait_ready(server, lambda: _answers(url, **with_cert))
        assert not _answers(url, verify=str(pki / "ca.pem"))  # the handshake fails without a client certificate
    finally:
        _stop(server)


@pytest.mark.parametrize("flags, message", [
    (["--ssl-certfile", "/no/such.pem"], "--ssl-certfile: cannot load the certificate and its key (No such file"),
    (["--ssl-keyfile", "/k.pem", "--ssl-ca-certs", "/ca.pem"],
     "--ssl-keyfile, --ssl-ca-certs need --ssl-certfile"),
    (["--ssl-keyfile", "/k.pem"], "--ssl-keyfile needs --ssl-certfile"),
])
def test_tls_files_that_do_not_load_end_serve_before_the_model_loads(flags, message):
    completed = rerankit_cli("serve", "--model", "/no/such/model", *flags)
    assert completed.returncode == 2 and f"error: {message}" in completed.stderr, completed.stderr
    assert "/no/such/model" not in completed.stderr


def test_a_certificate_with_the_wrong_key_is_refused(pki):
    completed = rerankit_cli("serve", "--model", "/no/such/model", "--ssl-certfile", str(pki / "server.pem"),
                             "--ssl-keyfile", str(pki / "client.key"))
    assert completed.returncode == 2 and "--ssl-certfile and --ssl-keyfile: cannot load" in completed.stderr


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_sockets_that_never_start_their_handshake_count_against_max_connections(pki, loop):
    """Over the limit, the socket that has waited longest in its handshake makes room, as an idle plain-HTTP
    connection does (the header timeout is far off); a client that does its handshake is then answered."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    config = ServerConfig(max_connections=4, header_timeout_s=60, warm_up=False)
    server, listener = _tls_server(pki, loop, config)
    port = listener.getsockname()[1]
    with serving(server, listener):
        silent = []
        try:
            for _ in range(40):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            assert closed_by_server(silent[:-4], within_s=5) == 36, "sockets in their handshake were not counted"
            answer = httpx.get(f"https://127.0.0.1:{port}/health", verify=str(pki / "ca.pem"), timeout=10)
            assert answer.status_code == 200
            assert closed_by_server(silent[-4:-3], within_s=5) == 1, "the client made no room"
            assert closed_by_server(silent[-3:], within_s=0.2) == 0, "more than one made room"
        finally:
            for sock in silent:
                sock.close()


def _closed_within(sock: ssl.SSLSocket, seconds: float) -> bool:
    """Whether the server closes ``sock`` (its end of the stream, or an error) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except OSError:  # reset, or the TLS layer's EOF without a close_notify
        return True


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_handshake_and_the_first_requests_headers_share_one_header_timeout(pki, loop):
    """A client that takes 0.6 s to begin its handshake and then drips its headers is closed 1 s (the header
    timeout) after its accept, as it would be over plain HTTP; it had 1 s for the handshake and 1 s more for the
    headers. One that begins its handshake as late but sends its request at once is answered, and its next request
    has the header timeout from that answer, as on every kept-alive connection."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    timeout_s = 1.0
    config = ServerConfig(header_timeout_s=timeout_s, keep_alive_timeout_s=30, warm_up=False)
    server, listener = _tls_server(pki, loop, config)
    port = listener.getsockname()[1]
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with serving(server, listener):
        opened = time.monotonic()
        raw_drip = socket.create_connection(("127.0.0.1", port), timeout=10)
        raw_prompt = socket.create_connection(("127.0.0.1", port), timeout=10)
        time.sleep(0.6 * timeout_s)  # no ClientHello yet
        with context.wrap_socket(raw_drip, server_hostname="127.0.0.1") as drip, \
                context.wrap_socket(raw_prompt, server_hostname="127.0.0.1") as prompt:
            prompt.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            prompt.settimeout(10)
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                chunk = prompt.recv(4096)
                assert chunk, answer
                answer += chunk
            answered = time.monotonic()
            assert answer.startswith(b"HTTP/1.1 200"), answer

            closed = None
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 100:  # never whole
                try:
                    drip.sendall(bytes([byte]))
                except OSError:
                    closed = time.monotonic()
                    break
                if _closed_within(drip, 0.05):
                    closed = time.monotonic()
                    break
            assert closed is not None, "the dripping client was never closed"
            assert 0.95 * timeout_s <= closed - opened < 1.5 * timeout_s, (
                f"closed {closed - opened:.2f} s after it connected; its headers were due {timeout_s} s after it")
            # the answered connection, idle since its answer, is closed by the header timeout counted from then
            assert not _closed_within(prompt, max(0.0, answered + 0.9 * timeout_s - time.monotonic()))
            assert _closed_within(prompt, 2 * timeout_s)


def _tls_server(pki: Path, loop: str, config: ServerConfig) -> tuple[DrainingServer, socket.socket]:
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    app = create_app(RecordingBackend(), config)
    server = DrainingServer(uvicorn_config(app, config, log_level="critical", loop=loop, timeout_graceful_shutdown=8,
                                           ssl_certfile=str(pki / "server.pem"), ssl_keyfile=str(pki / "server.key")),
                            app.state.batcher, config.drain_seconds, config.header_timeout_s)
    return server, loopback_listener()


def _silent(port: int, context: ssl.SSLContext, count: int) -> list[ssl.SSLSocket]:
    """``count`` TLS connections whose handshake is done and that then send nothing, read nothing, never close;
    an EOF without close_notify raises (``suppress_ragged_eofs=False``)."""
    return [context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                server_hostname="127.0.0.1", suppress_ragged_eofs=False) for _ in range(count)]


def _sent_close_notify(sock: ssl.SSLSocket) -> bool:
    """Whether the server closed ``sock`` with a TLS close_notify (not a bare end of the stream, nor a reset)."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except (OSError, ssl.SSLError):
        return False


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="counts sockets in /proc")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tls_connections_past_their_header_deadline_free_their_sockets_though_the_client_never_answers(pki, loop,
                                                                                                      monkeypatch):
    """The header deadline closes a silent TLS connection with a close_notify, and the server lets its socket go
    about a second later though the client never answers it (the TLS layer's own wait: 30 s; with
    benchmarks/tls_silent.py, 200 sockets on either loop were let go 30.0 s past their deadline, now 1.0 s).
    Here the server waits 0.3 s, not TLS_CLOSE_WAIT_S's 1 s, for the answer that never comes."""
    monkeypatch.setattr(connections, "TLS_CLOSE_WAIT_S", 0.3)
    timeout_s, count = 0.5, 40
    server, listener = _tls_server(pki, loop, ServerConfig(header_timeout_s=timeout_s, warm_up=False))
    port = listener.getsockname()[1]
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with serving(server, listener):
        silent = _silent(port, context, count)
        try:
            assert server_sockets(port) == count
            took = held_until(port, 0, within_s=timeout_s + 4)
            assert took is not None, f"{server_sockets(port)} of {count} sockets still held {timeout_s + 4} s on"
            assert all(_sent_close_notify(sock) for sock in silent[:5])
        finally:
            for sock in silent:
                sock.close()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="counts sockets in /proc")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_silent_tls_connections_closed_to_make_room_idle_or_at_shutdown_free_their_sockets(pki, loop, monkeypatch):
    """Over --max-connections, the silent TLS connections closed to make room give way to a newcomer at once (it
    was answered 503 while they waited for their close_notify, 30 s) and let their sockets go within seconds, as
    does a client idle past the keep-alive timeout after its answer (both were held 30 s); a client that reads is
    answered and gets a clean close (close_notify both ways); stopping the server with silent TLS connections open
    takes about a second (was uvicorn's whole graceful-shutdown timeout). Here the server waits 0.5 s, not
    TLS_CLOSE_WAIT_S's 1 s, for a close_notify (the client that reads answers its own at once)."""
    monkeypatch.setattr(connections, "TLS_CLOSE_WAIT_S", 0.5)
    limit, count = 4, 12
    server, listener = _tls_server(pki, loop, ServerConfig(max_connections=limit, header_timeout_s=60,
                                                           keep_alive_timeout_s=0.5, warm_up=False))
    port = listener.getsockname()[1]
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    with serving(server, listener) as thread:
        silent = _silent(port, context, count)
        try:
            # at once answered, not 503: the connections closed to make room (still open, and counted, until their
            # client answers the close_notify) give way to it
            idle = _silent(port, context, 1)[0]
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"}"):
                chunk = idle.recv(4096)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer  # answered; then it neither reads nor closes
            client_port = idle.getsockname()[1]
            assert server_sockets(port, client_port) == 1
            assert held_until(port, limit, within_s=4) is not None, f"{server_sockets(port)} sockets held"
            assert held_until(port, 0, within_s=4, peer=client_port) is not None, "the idle socket is still held"
            assert _sent_close_notify(idle)
            idle.close()
            with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                     server_hostname="127.0.0.1", suppress_ragged_eofs=False) as client:
                client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := client.recv(4096):  # ends with the server's close_notify, else raises
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"status":"ok"}'), answer
                client.unwrap()  # its own close_notify: a clean close both ways
            assert held_until(port, limit, within_s=4) is not None
            stopping = time.monotonic()
            server.should_exit = True
            thread.join(10)
            assert not thread.is_alive()
            assert time.monotonic() - stopping < 4, f"stopping took {time.monotonic() - stopping:.1f} s"
            assert _sent_close_notify(silent[-1])
        finally:
            for sock in silent:
                sock.close()
