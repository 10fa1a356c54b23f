"""Data parallel on CPU: two replica processes score like one engine, and a killed one loses and repeats nothing."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rerankit.defaults import default_model_path
from rerankit.engine import EmbeddedBackend
from rerankit.engine.replica_worker import portable
from rerankit.engine.replica_process import Replica
from rerankit.engine.replicas import DataParallelBackend, replica_devices, spare_replicas
from rerankit.engine.shards import MIN_SHARD_TOKENS, Shard, cut, item_tokens, merge
from rerankit.errors import (Cancelled, InvalidRequest, ModelLoadError, ReplicaDied, RequestTooLarge,
                             RerankitError)
from rerankit.reranker import make_backend
from rerankit.schema import ScoreRequest

DOCS = [f"document {number} on the capital of france and gravity " * (1 + number % 5) for number in range(150)]


@pytest.fixture(scope="module")
def single() -> EmbeddedBackend:
    backend = EmbeddedBackend(default_model_path(), device="cpu", show_progress=False)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def replicas() -> DataParallelBackend:
    # pipelined: each replica runs two tasks at once on its own threads, as a GPU replica does
    backend = make_backend(None, device="cpu", data_parallel_size=2, startup_timeout_s=120, pipelined=True)
    yield backend
    backend.close()


REQUESTS = [ScoreRequest(query="capital of france", items=DOCS),  # cut across both replicas
            ScoreRequest(query="gravity", items=DOCS[5:12]),  # kept whole
            ScoreRequest(query="one", items=["a single document"])]


@pytest.fixture(scope="module")
def expected(single: EmbeddedBackend) -> list:
    return single.score_batch(REQUESTS)


def assert_same(got, expected, tolerance: float = 1e-5) -> None:
    for response, reference in zip(got, expected, strict=True):
        assert [result.index for result in response.results] == list(range(len(reference.results)))
        # a cut request runs in other micro-batches than the whole one: float32 sums may differ in the last bits
        assert response.scores == pytest.approx(reference.scores, abs=tolerance)
        assert response.usage.prompt_tokens == reference.usage.prompt_tokens


def test_cut_covers_every_item_once_in_contiguous_runs() -> None:
    requests = REQUESTS
    shards = cut(requests, 2)
    large = [shard for shard in shards if shard.position == 0]
    assert len(large) == 2 and large[0].stop == large[1].start
    assert sum(item_tokens(requests[0])) > 2 * MIN_SHARD_TOKENS
    for position, request in enumerate(requests):
        covered = [item for shard in shards if shard.position == position for item in range(shard.start, shard.stop)]
        assert covered == list(range(len(request.items)))
    assert len(cut(requests, 1)) == len(requests)


def test_a_shards_error_names_the_item_counted_from_the_requests_start() -> None:
    requests = [ScoreRequest(query="q", items=DOCS[:10]), ScoreRequest(query="q", items=DOCS[:10])]
    shards = [Shard(0, 0, 6, 1), Shard(0, 6, 10, 1), Shard(1, 0, 4, 1), Shard(1, 4, 10, 1)]
    refused = InvalidRequest("items[2]", "has at least 600 tokens")
    too_large = RequestTooLarge("items[1]", "is too large", limit=5)
    merged = merge(requests, shards, [refused, refused, ValueError("other"), too_large])
    assert merged[0] is refused  # the first shard's: its items start at 0
    assert isinstance(merged[1], ValueError)  # the first failed shard stands for its request
    merged = merge(requests[1:], [Shard(0, 0, 4, 1), Shard(0, 4, 10, 1)], [_response(4), too_large])
    error = merged[0]
    assert type(error) is RequestTooLarge and error.field == "items[5]" and error.limit == 5
    assert str(error) == "items[5]: is too large" and error.reason == "is too large"


def _response(items: int):
    from rerankit.schema import ScoreResponse, ScoreResult, Usage

    return ScoreResponse(results=[ScoreResult(index=index, score=0.0) for index in range(items)], model="m",
                         usage=Usage(prompt_tokens=items, computed_tokens=items))


def test_calls_are_cut_only_across_replicas_with_room_for_another_task() -> None:
    def replica(index: int, tasks: int, state: str = "ready") -> Replica:
        made = Replica(index, "cuda", state=state, pipelined_calls=2)
        made.tasks = {number: None for number in range(tasks)}
        return made

    assert spare_replicas([replica(0, 0), replica(1, 0)]) == 2  # a lone call is cut across both
    assert spare_replicas([replica(0, 1), replica(1, 2)]) == 1  # one has room
    assert spare_replicas([replica(0, 2), replica(1, 3)]) == 1  # both full: whole requests, to the least loaded
    assert spare_replicas([replica(0, 0, "down"), replica(1, 0), replica(2, 0, "starting")]) == 1  # ready ones only
    long = ScoreRequest(query="capital of france", items=DOCS)
    assert len(cut([long], spare_replicas([replica(0, 2), replica(1, 2)]))) == 1


class FakeProcess:
    def __init__(self, pid: int, alive: bool = True) -> None:
        self.pid, self.alive = pid, alive

    def is_alive(self) -> bool:
        return self.alive


def backend_of(*replicas: Replica) -> DataParallelBackend:
    """A backend over ``replicas`` (fakes: no process is started), for what it tells of them."""
    backend = DataParallelBackend.__new__(DataParallelBackend)
    backend._lock = threading.Lock()
    backend._ready = threading.Condition(backend._lock)
    backend._closing, backend._started, backend._replicas = False, False, list(replicas)
    return backend


def test_replica_pids_and_status_report_a_replica_not_running_as_none() -> None:
    ready = Replica(0, "cpu", process=FakeProcess(11), state="ready")
    ended = Replica(1, "cpu", process=FakeProcess(12, alive=False), state="ready")  # its death not handled yet
    down = Replica(2, "cpu", process=FakeProcess(13), state="down")  # its process object outlives it
    starting = Replica(3, "cpu", process=FakeProcess(14), state="starting")  # a restart: its new process
    backend = backend_of(ready, ended, down, starting)
    assert backend.replica_pids == [11, None, None, 14]
    status = backend.replica_status()
    assert [replica.state for replica in status] == ["ready", "ready", "down", "starting"]
    assert [replica.pid for replica in status] == [11, None, None, 14]
    assert status[0].failures == {"died": 0, "timed_out": 0, "failed_to_start": 0}


def test_problem_says_why_while_no_replica_is_ready_and_a_failed_load_is_counted() -> None:
    first = Replica(0, "cpu", process=FakeProcess(11), state="starting")
    second = Replica(1, "cpu", process=FakeProcess(12), state="ready")
    backend = backend_of(first, second)
    assert backend.problem() is None  # one ready: degraded, still serving
    with backend._lock:
        backend._handle(second, ("load_failed", ModelLoadError("out of memory")))  # as the backend starts
    assert second.state == "down" and second.failures["failed_to_start"] == 1
    assert backend.problem() == "no replica is ready: 1 restarting (loading the model), 1 down"
    first.state = "down"
    assert "no replica is running" in backend.problem()


def test_data_parallel_size_is_checked_before_any_process_starts() -> None:
    with pytest.raises(InvalidRequest, match="data_parallel_size"):
        replica_devices("cpu", 0)
    with pytest.raises(InvalidRequest, match="data_parallel_size"):
        replica_devices("cpu", "all")
    assert replica_devices("cpu", 3) == ["cpu"] * 3


def test_auto_that_makes_one_replica_keeps_the_engine_in_process() -> None:
    backend = make_backend(None, device="cpu", data_parallel_size="auto", startup_timeout_s=5)
    try:
        assert isinstance(backend, EmbeddedBackend)
    finally:
        backend.close()


def test_two_replicas_score_like_one(replicas: DataParallelBackend, expected: list) -> None:
    assert_same(replicas.score_batch(REQUESTS), expected)
    assert replicas.score(REQUESTS[1]).scores == pytest.approx(expected[1].scores, abs=1e-6)


def test_calls_from_several_threads_keep_two_tasks_a_replica_in_flight_and_score_like_one(
        replicas: DataParallelBackend, expected: list) -> None:
    assert replicas.pipelined_calls == 4
    outcomes: list = [None] * 6

    def call(index: int) -> None:
        outcomes[index] = replicas.score_batch(REQUESTS)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(len(outcomes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for got in outcomes:
        assert_same(got, expected)


def test_a_refused_request_keeps_its_typed_error_and_the_others_are_scored(
        replicas: DataParallelBackend, single: EmbeddedBackend) -> None:
    bad = ScoreRequest(query="q", items=[[10**9]])  # a token id past the vocabulary
    good = ScoreRequest(query="gravity", items=DOCS[:3])
    outcomes = replicas.score_batch([good, bad], return_exceptions=True)
    assert outcomes[0].scores == pytest.approx(single.score(good).scores, abs=1e-6)
    assert isinstance(outcomes[1], InvalidRequest) and outcomes[1].field
    own = single.score_batch([bad], return_exceptions=True)[0]  # the same error, raised in this process
    assert type(outcomes[1]) is type(own) and vars(outcomes[1]) == vars(own) and outcomes[1].args == own.args
    with pytest.raises(InvalidRequest):
        replicas.score_batch([good, bad])


class KeywordOnlyError(Exception):
    """Pickles, but cannot be rebuilt from its args: as some third-party exceptions."""

    def __init__(self, message: str, *, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def test_an_error_that_cannot_cross_processes_is_sent_as_a_rerankit_error_naming_it() -> None:
    error = RequestTooLarge("items", "too many", 3)
    plain = ValueError("bad")
    assert portable(error) is error and portable(plain) is plain
    replaced = portable(KeywordOnlyError("no room", detail="x"))
    assert type(replaced) is RerankitError and "KeywordOnlyError: no room" in replaced.message


def test_a_replica_that_cannot_load_fails_the_constructor_with_its_error(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="did not start: .*no model folder"):
        DataParallelBackend(str(tmp_path / "absent"), data_parallel_size=1, device="cpu", startup_timeout_s=120)


def test_should_stop_cancels_the_call(replicas: DataParallelBackend) -> None:
    with pytest.raises(Cancelled):
        replicas.score_batch(REQUESTS, should_stop=lambda: True)


def test_warm_up_sends_the_servers_shapes_and_the_replicas_report_max_length(
        replicas: DataParallelBackend, single: EmbeddedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    from rerankit.server.batcher import _accepts

    assert replicas.max_length == single.max_length  # the server's per-item cap in its token estimate
    assert _accepts(replicas.warm_up, "shapes")  # the server passes its shapes only then
    sent: list = []
    send = replicas._send
    monkeypatch.setattr(replicas, "_send", lambda task, replica: sent.append(task.payload) or send(task, replica))
    assert replicas.warm_up(shapes=[(2, 10)]) > 0
    assert sent == [[(2, 10)]] * 2


def test_a_killed_replica_is_restarted_and_its_work_retried_once(
        replicas: DataParallelBackend, expected: list, caplog: pytest.LogCaptureFixture) -> None:
    victim = replicas._replicas[0]
    old_pid = victim.process.pid
    outcome: dict = {}
    call = threading.Thread(target=lambda: outcome.setdefault("got", replicas.score_batch(REQUESTS)))
    call.start()
    deadline = time.monotonic() + 30
    while not victim.tasks:  # the call's work for replica 0 is on its way
        assert time.monotonic() < deadline and call.is_alive()
        time.sleep(0.005)
    os.kill(old_pid, signal.SIGKILL)
    call.join(120)
    assert not call.is_alive(), "the call did not finish after its replica was killed"
    assert_same(outcome["got"], expected)
    assert "replica 0 on cpu died" in caplog.text and "holding 1 task(s)" in caplog.text  # it was retried
    deadline = time.monotonic() + 120
    while victim.state != "ready":  # restarted in the background
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.05)
    assert replicas.replica_pids[0] != old_pid and victim.restarts == 1
    status = replicas.replica_status()[0]
    assert status.failures == {"died": 1, "timed_out": 0, "failed_to_start": 0} and status.restarts == 1
    assert status.pid == victim.process.pid and status.state == "ready"
    assert_same(replicas.score_batch(REQUESTS), expected)


def test_a_replica_makes_no_named_semaphore_of_its_own(replicas: DataParallelBackend) -> None:
    """A replica holds no named semaphore but its inbox's, which the parent made and takes back: one the replica
    made (tqdm's lock, made by the first bar, even a disabled one) stays registered when the replica is killed, and
    the parent's exit warns "There appear to be 1 leaked semaphore objects"."""
    if not os.path.exists(f"/proc/{os.getpid()}/maps") or not os.path.isdir("/dev/shm"):
        pytest.skip("needs Linux's /proc and /dev/shm")
    replicas.score_batch(REQUESTS)  # each replica has scored: the engine built its (disabled) progress bars
    for replica in replicas._replicas:
        inbox = replica.inbox
        made_here = {os.stat("/dev/shm/sem." + lock._semlock.name.lstrip("/")).st_ino
                     for lock in (inbox._rlock, inbox._wlock, inbox._sem)}
        with open(f"/proc/{replica.process.pid}/maps") as maps:  # a semaphore is a mapped /dev/shm/sem.* file
            mapped = {int(line.split()[4]) for line in maps if " /dev/shm/sem." in line}
        assert mapped == made_here, f"replica {replica.index} made {len(mapped - made_here)} semaphore(s)"


def test_work_whose_retry_dies_too_fails_with_replica_died(fake) -> None:
    """Fake replicas, stopped so that they hold the work they are sent (the parent's retry is what is tested; and
    the shared replicas are left running, not restarting both in the background)."""
    backend = fake("ready", size=2)
    first, second = backend._replicas
    for replica in (first, second):
        os.kill(replica.process.pid, signal.SIGSTOP)
    outcome: dict = {}

    def call() -> None:
        try:
            backend.score_batch(REQUESTS)
        except ReplicaDied as error:
            outcome["error"] = error

    caller = threading.Thread(target=call)
    caller.start()
    try:
        deadline = time.monotonic() + 30
        while not first.tasks:
            assert time.monotonic() < deadline and caller.is_alive()
            time.sleep(0.005)
        os.kill(first.process.pid, signal.SIGKILL)
        while not any(task.retried for task in second.tasks.values()):  # replica 1 now holds replica 0's work
            assert time.monotonic() < deadline and caller.is_alive()
            time.sleep(0.005)
        os.kill(second.process.pid, signal.SIGKILL)
        caller.join(60)
        assert not caller.is_alive() and "already been retried once" in str(outcome["error"])
    finally:
        for replica in (first, second):
            if replica.process.is_alive():
                os.kill(replica.process.pid, signal.SIGCONT)


GPU_TOLERANCE = 2e-3  # float32 on a GPU: Triton's dots take TF32 inputs, and batches differ where a request is cut


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs")
def test_gpu_replicas_on_two_devices_score_like_one_with_calls_in_flight(tiny_qwen3_lm) -> None:
    """A model on cuda:1 (Triton kernels and CUDA graphs on a device that is not the default one), and two GPU
    replicas taking four calls at once (two pipelined on each), score like one engine on cuda:0."""
    path = str(tiny_qwen3_lm)
    requests = [ScoreRequest(query="capital of france", items=DOCS[:40], template="qwen3-reranker"),
                ScoreRequest(query="gravity", items=DOCS[40:47], template="qwen3-reranker")]
    first = EmbeddedBackend(path, device="cuda:0", dtype="float32", show_progress=False)
    expected = first.score_batch(requests)
    first.close()
    second = EmbeddedBackend(path, device="cuda:1", dtype="float32", show_progress=False)
    second.warm_up()
    assert_same(second.score_batch(requests), expected, GPU_TOLERANCE)
    second.close()
    with DataParallelBackend(path, device="cuda", data_parallel_size=2, dtype="float32") as backend:
        assert backend.pipelined_calls == 4
        backend.warm_up()
        outcomes: list = [None] * 8

        def call(index: int) -> None:
            outcomes[index] = backend.score_batch(requests)

        threads = [threading.Thread(target=call, args=(index,)) for index in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for got in outcomes:
            assert_same(got, expected, GPU_TOLERANCE)


def test_close_stops_the_live_replicas_when_one_stays_down(fake, monkeypatch) -> None:
    """Fake replicas: what is tested is the parent's close."""
    import rerankit.engine.restart_policy as restart_policy

    monkeypatch.setattr(restart_policy, "MAX_RESTARTS", 0)  # the first death keeps a replica down
    backend = fake("ready", size=2)
    down, live = backend._replicas
    os.kill(down.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while down.state != "down":
        assert time.monotonic() < deadline, "the killed replica was not marked down"
        time.sleep(0.02)
    assert backend.score(REQUESTS[1]).scores and backend.problem() is None  # the live replica serves
    assert backend.replica_pids == [None, live.process.pid]  # it listed the dead process's pid
    assert [(replica.state, replica.failures["died"]) for replica in backend.replica_status()] == [("down", 1),
                                                                                                 ("ready", 0)]
    backend.close()  # it raised on the down replica's closed queue and left the live one running
    assert not live.process.is_alive() and backend.problem() == "the backend is closed"
    assert backend.replica_pids == [None, None]
    with pytest.raises(ModelLoadError, match="closed"):
        backend.score(REQUESTS[1])
    live.state = "down"  # every replica down, as after too many deaths: what a server's /health answers 503 with
    backend._closing = False
    assert "no replica is running" in backend.problem()
    backend._closing = True


def test_a_backend_never_closed_is_closed_at_exit_without_false_deaths() -> None:
    import subprocess
    import sys

    script = ("from rerankit import Reranker\n"
              "reranker = Reranker(device='cpu', data_parallel_size=2)\n"
              "print(len(reranker.rank('capital of france', ['Paris', 'Berlin'])))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-3000:]
    assert "died" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
