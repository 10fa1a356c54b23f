"""A real uvicorn server on 127.0.0.1 in a thread of the test process, on a port the OS picks."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
import selectors
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import uvicorn
from uvicorn.server import logger

from rerankit.server.connections import uvicorn_config
from rerankit.server.limits import ServerConfig


def loopback_listener() -> socket.socket:
    """A TCP socket bound to 127.0.0.1 on a port the OS picks."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then; without it Nagle's
    # algorithm and delayed ACKs add ~40 ms to every response.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    return listener


class PromptServer(uvicorn.Server):
    """uvicorn's server, whose main loop sees ``should_exit`` as soon as ``wake`` is called rather than at its next
    0.1 s tick (uvicorn's own loop, otherwise: on_tick every 0.1 s). About 0.05 s off each of the ~90 servers
    the tests stop. Its shutdown skips uvicorn's fixed pause where no connection is left (``_prompt_shutdown``)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _woken: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._woken = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            try:
                await asyncio.wait_for(self._woken.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
            should_exit = await self.on_tick(counter)

    def wake(self) -> None:
        """Have the main loop look at ``should_exit`` now (from any thread)."""
        loop, woken = self._loop, self._woken
        if loop is not None and woken is not None:
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # the loop has closed: the server is already gone
                pass


# uvicorn.Server.shutdown as uvicorn 0.54 ships it (the sha256 of its source): ``_prompt_shutdown`` copies it.
STOCK_SHUTDOWN_SHA256 = "9b33c50562992b1e3cef2a9611408ece6c01d46ee17eaae2091b6091bf826eab"


async def _prompt_shutdown(self: PromptServer, sockets: list[socket.socket] | None = None) -> None:
    """uvicorn's shutdown, but for its fixed 0.1 s pause after asking each connection to shut down: here that pause
    ends as soon as no connection is left (at once where none was open; it still lasts 0.1 s at the most). About
    0.1 s off each of the ~200 servers the tests stop. Used only over the uvicorn code it copies."""
    logger.info("Shutting down")
    for server in self.servers:
        server.close()
    for sock in sockets or []:
        sock.close()
    for connection in list(self.server_state.connections):
        connection.shutdown()
    paused = asyncio.get_running_loop().time() + 0.1
    while self.server_state.connections and asyncio.get_running_loop().time() < paused:
        await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(self._wait_tasks_to_complete(), timeout=self.config.timeout_graceful_shutdown)
    except asyncio.TimeoutError:
        logger.error("Cancel %s running task(s), timeout graceful shutdown exceeded", len(self.server_state.tasks))
        for task in self.server_state.tasks:
            task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
    if not self.force_exit:
        await self.lifespan.shutdown()


if hashlib.sha256(inspect.getsource(uvicorn.Server.shutdown).encode()).hexdigest() == STOCK_SHUTDOWN_SHA256:
    PromptServer.shutdown = _prompt_shutdown  # type: ignore[method-assign]


@contextmanager
def serving(server: uvicorn.Server, listener: socket.socket) -> Iterator[threading.Thread]:
    """Run ``server`` on ``listener`` in a thread until the block ends; yields the thread once it has started."""
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield thread
    finally:
        server.should_exit = True
        if isinstance(server, PromptServer):
            server.wake()
        thread.join(10)
        listener.close()


@contextmanager
def live_server(app: Any, config: ServerConfig | None = None, **options: Any) -> Iterator[str]:
    """Serve the ASGI ``app`` on loopback until the block ends, with ``config``'s connection settings, as
    ``rerankit serve`` does (``options``: ``uvicorn_config``'s); yields the base URL."""
    listener = loopback_listener()
    options = {"log_level": "warning", **options}
    server = PromptServer(uvicorn_config(app, config or ServerConfig(), lifespan="on", timeout_graceful_shutdown=2,
                                         **options))
    with serving(server, listener):
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def wait_until_healthy(process: subprocess.Popen, url: str, seconds: float = 60) -> None:
    """Return once the server ``process`` (``rerankit serve``'s, at ``url``) answers ``/health`` with 200; fail the
    test if it exits or has not answered within ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, f"the server exited with status {process.returncode}"
        assert time.monotonic() < deadline, f"the server did not answer /health within {seconds:g} s"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)


def closed_by_server(sockets: list[socket.socket], within_s: float) -> int:
    """How many of ``sockets`` the server closed (EOF or reset) within ``within_s`` seconds."""
    with selectors.DefaultSelector() as selector:
        for sock in sockets:
            selector.register(sock, selectors.EVENT_READ)
        closed, deadline = 0, time.monotonic() + within_s
        while closed < len(sockets) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    data = key.fileobj.recv(4096)
                except ConnectionError:
                    data = b""
                if not data:
                    selector.unregister(key.fileobj)
                    closed += 1
    return closed


def server_sockets(port: int, peer: int | None = None) -> int:
    """How many open files of this process are the server's end of a connection on ``port`` (its listener left
    out), of the client whose port is ``peer`` (None: any): the sockets the server in this process still holds,
    whatever the clients do with theirs."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16)
        if local == port and fields[3] != "0A" and peer in (None, remote):  # 0A: LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    held = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            held += os.readlink(fd) in inodes
        except OSError:  # closed since the listing
            pass
    return held


def held_until(port: int, at_most: int, within_s: float, peer: int | None = None) -> float | None:
    """Seconds until the server holds ``at_most`` sockets of ``port`` (of the client at port ``peer``) or fewer;
    None if not within ``within_s``."""
    began = time.monotonic()
    while server_sockets(port, peer) > at_most:
        if time.monotonic() - began > within_s:
            return None
        time.sleep(0.05)
    return time.monotonic() - began
