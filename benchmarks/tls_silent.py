"""TLS sockets that finish their handshake and then go silent, never reading and never closing, against the HTTPS
server of ``rerankit serve`` (``DrainingServer`` on a fake backend that needs no model, in a subprocess): what the
server process holds after the connection guard has closed them (the header deadline, or room made over
``--max-connections``), and how long stopping it takes while such sockets are open.

    PYTHONPATH=src python benchmarks/tls_silent.py                        # this checkout's code, both loops
    PYTHONPATH=src python benchmarks/tls_silent.py --src /tmp/before/src  # the same against another checkout

Each row starts its own server, opens ``--sockets`` TLS connections (each handshake done, nothing sent after it)
and samples the server's open file descriptors (``/proc/<pid>/fd``) and RSS (``VmRSS``) every 0.1 s. It prints one
JSON line: the fds and RSS before the flood and at their peak, the seconds from the last socket's header deadline
(its accept + ``--header-timeout``) until the fds are back at their count before the flood (``released_s``; null:
not within ``--watch`` seconds), and for the ``shutdown`` row the seconds SIGINT takes to end the server while
the sockets are open (their header deadline far off). Rows: ``deadline`` (a limit far off: every socket is closed
by its header deadline), ``make_room`` (``--max-connections``: each newcomer closes the oldest), ``shutdown``,
and ``flood``: ``--rate`` silent sockets a second for ``--flood-seconds`` under ``--max-connections``, the fds
and RSS at the end of it (``fds_end``, ``rss_kib_end``) and at their peak.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER = """
import sys
sys.path[:0] = [{src!r}, {tests!r}]
from server_fakes import RecordingBackend
from rerankit.server.app import create_app
from rerankit.server.connections import uvicorn_config
from rerankit.server.limits import ServerConfig
from rerankit.server.shutdown import GRACE_AFTER_DRAIN_S, DrainingServer
from live_server import loopback_listener
config = ServerConfig(max_connections={max_connections}, header_timeout_s={header_timeout}, drain_seconds=1,
                      warm_up=False)
app = create_app(RecordingBackend(), config)
listener = loopback_listener()
print(listener.getsockname()[1], flush=True)
server = DrainingServer(uvicorn_config(app, config, log_level="warning", loop={loop!r}, ssl_certfile={cert!r},
                                       ssl_keyfile={key!r}, timeout_graceful_shutdown=1 + GRACE_AFTER_DRAIN_S),
                        app.state.batcher, config.drain_seconds, config.header_timeout_s)
server.run(sockets=[listener])
"""


def certificate(folder: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, as PEM files in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return str(folder / "cert.pem"), str(folder / "key.pem")


def sample(pid: int) -> tuple[int, int]:
    """(open fds, RSS in KiB) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return fds, int(line.split()[1])
    return fds, 0


def row(args: argparse.Namespace, loop: str, kind: str, cert: str, key: str) -> dict:
    header_timeout = 60.0 if kind == "shutdown" else args.header_timeout
    max_connections = args.max_connections if kind in ("make_room", "flood") else 4096
    code = SERVER.format(src=args.src, tests=str(ROOT / "tests"), max_connections=max_connections,
                         header_timeout=header_timeout, loop=loop, cert=cert, key=key)
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": args.src})
    port = int(server.stdout.readline())
    context = ssl.create_default_context(cafile=cert)
    # the server is up once a client is answered
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname="127.0.0.1") as probe:
                probe.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                while probe.recv(4096):
                    pass
            break
        except (OSError, ssl.SSLError):
            time.sleep(0.05)
    time.sleep(0.5)  # the probe's own socket gone
    base_fds, base_rss = sample(server.pid)
    silent = []
    result = {"loop": loop, "row": kind, "sockets": args.sockets, "header_timeout_s": header_timeout,
              "max_connections": max_connections, "fds_before": base_fds, "rss_kib_before": base_rss}
    if kind == "flood":
        began, peak_fds, peak_rss = time.monotonic(), base_fds, base_rss
        while time.monotonic() < began + args.flood_seconds:
            due = began + len(silent) / args.rate
            if time.monotonic() < due:
                fds, rss = sample(server.pid)
                peak_fds, peak_rss = max(peak_fds, fds), max(peak_rss, rss)
                time.sleep(max(0.0, min(0.05, due - time.monotonic())))
                continue
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            silent.append(context.wrap_socket(raw, server_hostname="127.0.0.1"))
        fds, rss = sample(server.pid)
        result.update(sockets=len(silent), rate=args.rate, fds_end=fds, rss_kib_end=rss,
                      fds_peak=max(peak_fds, fds), rss_kib_peak=max(peak_rss, rss))
        server.send_signal(signal.SIGINT)
        server.wait(120)
        for sock in silent:
            sock.close()
        return result
    for _ in range(args.sockets):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        silent.append(context.wrap_socket(raw, server_hostname="127.0.0.1"))  # handshake done, then nothing
    flooded = time.monotonic()
    peak_fds, peak_rss = sample(server.pid)
    if kind == "shutdown":
        time.sleep(0.5)
        peak_fds, peak_rss = sample(server.pid)
        began = time.monotonic()
        server.send_signal(signal.SIGINT)
        server.wait(120)
        result.update(fds_peak=peak_fds, rss_kib_peak=peak_rss, stop_s=round(time.monotonic() - began, 2))
    else:
        due = flooded + header_timeout  # the last socket's header deadline (at the latest)
        released, at_due, rss_end = None, None, None
        while time.monotonic() < due + args.watch:
            fds, rss = sample(server.pid)
            peak_fds, peak_rss = max(peak_fds, fds), max(peak_rss, rss)
            if at_due is None and time.monotonic() >= due + 0.5:
                at_due = fds
            if time.monotonic() >= due and fds <= base_fds and released is None:
                released = round(time.monotonic() - due, 2)
                rss_end = rss
                break
            time.sleep(0.1)
        result.update(fds_peak=peak_fds, rss_kib_peak=peak_rss, fds_half_s_after_deadline=at_due,
                      released_s=released, rss_kib_released=rss_end)
        server.send_signal(signal.SIGINT)
        server.wait(120)
    for sock in silent:
        sock.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=str(ROOT / "src"), help="the rerankit source tree to serve")
    parser.add_argument("--sockets", type=int, default=200)
    parser.add_argument("--header-timeout", type=float, default=1.0)
    parser.add_argument("--max-connections", type=int, default=8, help="of the make_room and flood rows")
    parser.add_argument("--rate", type=float, default=40.0, help="silent sockets a second, flood row")
    parser.add_argument("--flood-seconds", type=float, default=20.0)
    parser.add_argument("--watch", type=float, default=40.0, help="seconds after the deadline to wait for release")
    parser.add_argument("--loops", default="asyncio,uvloop")
    parser.add_argument("--rows", default="deadline,make_room,shutdown,flood")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cert, key = certificate(Path(folder))
        for loop in args.loops.split(","):
            for kind in args.rows.split(","):
                print(json.dumps(row(args, loop, kind, cert, key)), flush=True)


if __name__ == "__main__":
    main()
