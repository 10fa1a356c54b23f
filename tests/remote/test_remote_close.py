"""``close()`` ends the calls running, sync or async, from whichever thread or event loop it is called, and refuses
the calls begun after it: against a URL where nothing listens (the waits between tries and discovery's rounds are
20 s, a minute in all) and a fault server that holds its replies. The sync calls' waits are in
test_remote_startup.py and test_remote_deadlines.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import pytest
from fault_server import expected_scores, items

import rerankit.remote.closing as closing
import rerankit.remote.discover as discovery
from rerankit.errors import Cancelled
from rerankit.remote import RemoteBackend, Timeout
from rerankit.schema import ScoreRequest

# Waits far longer than any test: only close() can end these calls in time.
WAITING = {"deadline": 60, "timeout": Timeout(connect=0.5, read=30.0), "backoff_base": 20, "backoff_max": 20,
           "max_retries": 1000}
CLOSED_WHILE_RUNNING = "the remote backend was closed while this call ran"
CLOSED_BEFORE = "the remote backend was closed before this call began: make a new one to score again"
PROMPT = 0.5  # how soon after close() the call must be over (it ends at once; a loaded box schedules late)
WAITS = pytest.mark.parametrize("dialect", [None, "cohere", "tei"],
                                ids=["discovery", "served model", "scoring tries"])


@pytest.fixture(autouse=True)
def fresh_discovery():
    discovery.forget()
    yield
    discovery.forget()


def request(count: int = 2, labels: bool = True) -> ScoreRequest:
    """A request the fault server scores (``/generative_scoring``); without labels, one every dialect takes."""
    return ScoreRequest(query="q", items=items(count), **({"label_token_ids": [1, 2]} if labels else {}))


def watch_tries(backend: RemoteBackend) -> threading.Event:
    """Set once the backend's async client has made its first try (a discovery probe or a scoring request)."""
    tried, exchange = threading.Event(), backend.transport._aexchange

    async def first_try(*args, **kwargs):
        tried.set()
        return await exchange(*args, **kwargs)

    backend.transport._aexchange = first_try
    return tried


async def settled() -> set[asyncio.Task]:
    """The tasks of the running loop other than this one, once they have had 1 s to finish."""
    ends = time.monotonic() + 1.0
    while (others := asyncio.all_tasks() - {asyncio.current_task()}) and time.monotonic() < ends:
        await asyncio.sleep(0.01)
    return others


def async_call_in_thread(backend: RemoteBackend, count: int = 2, labels: bool = True):
    """``backend.ascore`` on an event loop of its own thread; the thread and what came out: the error raised (or
    the response) and the loop's tasks left once it ended."""
    outcome: list = []

    async def call():
        try:
            outcome.append(await backend.ascore(request(count, labels)))
        except Exception as error:  # noqa: BLE001 - the test reads what came out
            outcome.append(error)
        outcome.append(await settled())

    caller = threading.Thread(target=asyncio.run, args=(call(),), daemon=True)
    caller.start()
    return caller, outcome


@WAITS
def test_closing_from_another_thread_ends_an_async_call_waiting_for_its_server(dead_url, dialect):
    """An async call on a loop in another thread, waiting for a server that is not up -- between discovery's rounds
    (its dialect, or the model Cohere's dialect needs) or a scoring call's tries -- ends at once with ``Cancelled``,
    as a sync call does, and leaves no task behind on its loop."""
    backend = RemoteBackend(dead_url, dialect=dialect, **WAITING)
    tried = watch_tries(backend)
    caller, outcome = async_call_in_thread(backend, labels=False)
    assert tried.wait(10), "the call never tried the server"
    time.sleep(0.05)  # into the wait that follows the refused connection
    started = time.monotonic()
    backend.close()
    caller.join(PROMPT)
    assert not caller.is_alive(), "the call still waits after close()"
    assert time.monotonic() - started < PROMPT
    assert isinstance(outcome[0], Cancelled) and str(outcome[0]) == CLOSED_WHILE_RUNNING, repr(outcome[0])
    assert outcome[1] == set(), f"tasks left on the call's loop: {outcome[1]}"
    assert discovery._cache == {} and discovery._model_cache == {}


@WAITS
@pytest.mark.parametrize("how", ["close", "aclose"])
async def test_closing_on_the_calls_own_loop_ends_an_async_call_waiting_for_its_server(dead_url, dialect, how):
    backend = RemoteBackend(dead_url, dialect=dialect, **WAITING)
    tried = watch_tries(backend)
    call = asyncio.ensure_future(backend.ascore(request(labels=False)))
    while not tried.is_set() and not call.done():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert not call.done(), "still waiting for the server"
    started = time.monotonic()
    if how == "close":
        backend.close()  # sync, from another task of the same loop
    else:
        await backend.aclose()
    with pytest.raises(Cancelled, match=f"^{CLOSED_WHILE_RUNNING}$"):
        await asyncio.wait_for(call, PROMPT)
    assert time.monotonic() - started < PROMPT
    assert await settled() == set()


@pytest.mark.parametrize("split", [1, 3], ids=["one request", "split"])
def test_closing_drops_an_async_calls_requests_in_flight(servers, split):
    """The far server holds the requests unanswered: close() from another thread ends the async call at once and
    closes their connections, rather than leaving them open until the deadline."""
    server = servers(default="hold")
    backend = RemoteBackend(server.url, dialect="vllm-generative", max_items_per_request=3 // split, **WAITING)
    caller, outcome = async_call_in_thread(backend, count=3)
    ends = time.monotonic() + 5
    while server.in_flight < split and time.monotonic() < ends:
        time.sleep(0.01)
    assert server.in_flight == split, "the requests never reached the server"
    started = time.monotonic()
    backend.close()
    caller.join(PROMPT)
    assert not caller.is_alive(), "the call still waits after close()"
    assert isinstance(outcome[0], Cancelled) and str(outcome[0]) == CLOSED_WHILE_RUNNING, repr(outcome[0])
    assert outcome[1] == set(), f"tasks left on the call's loop: {outcome[1]}"
    while server.abandoned < split and time.monotonic() - started < 1.0:
        time.sleep(0.01)
    assert server.abandoned == split, "a request of the closed call is still open"
    assert server.hits == split, "a request was sent again"


@pytest.mark.parametrize("used", [False, True], ids=["new", "used"])
@pytest.mark.parametrize("dialect", [None, "vllm-generative"], ids=["discovery", "dialect"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_call_begun_after_close_fails_at_once(servers, use_async, dialect, used):
    """Nothing is sent, no pool or thread is started again, and the error says why."""
    server = servers()
    server.probes = deque()  # answer discovery as vLLM does
    backend = RemoteBackend(server.url, dialect=dialect, max_items_per_request=1, **WAITING)  # a split call
    if used:
        assert (await backend.ascore(request()) if use_async else backend.score(request())).scores == \
            expected_scores(2)
        discovery.forget()
    asked = (server.hits, len(server.gets))
    backend.close()
    started = time.monotonic()
    with pytest.raises(Cancelled, match=f"^{CLOSED_BEFORE}$"):
        await backend.ascore(request()) if use_async else backend.score(request())
    assert time.monotonic() - started < 0.1
    assert (server.hits, len(server.gets)) == asked, "the closed backend asked the server"
    transport = backend.transport
    assert transport._client is None and transport._loop_clients == {}, "a pool was opened again"
    assert transport._executor is None, "threads were started again"


async def test_a_closed_backend_does_not_ask_its_server_for_its_model(servers):
    """What a proxy answers at its /v1/models once its backend is closed: nothing is asked, no error escapes."""
    server = servers()
    server.probes = deque()
    backend = RemoteBackend(server.url, dialect="vllm-generative")
    await backend.aclose()
    assert await backend.aserved_model() is None
    assert server.gets == []


async def test_a_closed_backend_is_not_healthy_and_probes_nothing(servers):
    """What a proxy answers at its /health once its backend is closed: unhealthy, without asking the far server,
    even right after a call succeeded."""
    server = servers()
    server.probes = deque()
    backend = RemoteBackend(server.url, dialect="vllm-generative")
    assert (await backend.ascore(request())).scores
    assert await backend.ahealth() is None
    await backend.aclose()
    assert await backend.ahealth() == "the remote backend is closed"
    assert server.gets == []


class CloseWhen:
    """Closes ``backend`` from the moment the call it watches has begun (``deadline``: the call takes its deadline
    first) or is registering (``stop``: it makes the stop it registers) -- deterministically, just before the call
    is registered, where a close used to go unseen by the call."""

    def __init__(self, backend: RemoteBackend, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.closed = 0
        transport = backend.transport
        if where == "deadline":
            take_deadline = transport.deadline

            def deadline():
                self.close(backend)
                return take_deadline()

            monkeypatch.setattr(transport, "deadline", deadline)
        else:
            watcher = self

            class ClosingStop(closing.Stop):
                def __init__(self) -> None:
                    watcher.close(backend)
                    super().__init__()

            monkeypatch.setattr(closing, "Stop", ClosingStop)

    def close(self, backend: RemoteBackend) -> None:
        if not self.closed:
            self.closed += 1
            # From another thread, as close() comes in a real race; join(): it is over before the call goes on.
            closer = threading.Thread(target=backend.close)
            closer.start()
            closer.join(5)


@pytest.mark.parametrize("where", ["deadline", "stop"], ids=["as the call begins", "as the call registers"])
@pytest.mark.parametrize("dialect", [None, "vllm-generative"], ids=["discovery", "dialect"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_close_just_before_a_call_registers_is_seen_by_the_call(servers, monkeypatch, use_async, dialect,
                                                                         where):
    """A close() landing between a call's start and its registration with the transport: the call fails at once
    instead of running (and waiting) as if the backend were open."""
    server = servers()
    server.probes = deque()
    backend = RemoteBackend(server.url, dialect=dialect, **WAITING)
    closer = CloseWhen(backend, where, monkeypatch)
    started = time.monotonic()
    with pytest.raises(Cancelled, match=f"^{CLOSED_BEFORE}$"):
        await backend.ascore(request()) if use_async else backend.score(request())
    assert closer.closed == 1
    assert time.monotonic() - started < 0.5
    assert server.hits == 0 and server.gets == [], "the call asked the server after close()"


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_a_call_that_has_its_answers_when_close_comes_returns_them(servers, monkeypatch, use_async):
    """close() lands after every request of a split call was answered, before the call returns: the call returns
    its answers (nothing was stopped), and the next one is refused."""
    import rerankit.remote.client as client

    server = servers()
    backend = RemoteBackend(server.url, dialect="vllm-generative", max_items_per_request=1, **WAITING)
    first_error = client._first_error

    def closing_first(jobs):
        backend.close()
        return first_error(jobs)

    monkeypatch.setattr(client, "_first_error", closing_first)
    response = await backend.ascore(request(3)) if use_async else backend.score(request(3))
    assert response.scores == expected_scores(3)
    with pytest.raises(Cancelled, match=f"^{CLOSED_BEFORE}$"):
        await backend.ascore(request(3)) if use_async else backend.score(request(3))
