"""``DataParallelBackend``: one engine replica per device, each in its own process, behind one Backend.

Host-side launch time bounds this engine, so replicas do not share an interpreter: each is a spawned process
(``replica_worker.py``; spawn, not fork, as CUDA cannot be forked) that loads an ``EmbeddedBackend`` on its device.
The parent cuts a call into shards (``shards.py``: a large request is split by estimated tokens), hands each shard
to the replica with the least estimated work outstanding (so concurrent calls spread by load), and puts the answers
back in input order. One collector thread reads every replica's pipe and watches its process: a replica that dies
is logged as a ``ReplicaDied`` error and restarted (``restart_policy.py`` says when, when it is down instead, and
when one down is started once more), and the tasks it held go once to another replica; a task whose retry dies too
fails with ``ReplicaDied``. A task is answered once, by the first reply that arrives. A replica still loading
``startup_timeout_s`` after its start is killed. ``replica_status()`` tells each replica's state and failures (a
server's ``/health`` and ``/metrics`` read it).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import threading
import time
import weakref
from concurrent.futures import FIRST_EXCEPTION, wait
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable

from rerankit.engine.process_safety import score_cancellably
from rerankit.engine.replica_process import Replica, ReplicaStatus, Task
from rerankit.engine.replica_worker import replica_main
from rerankit.engine.restart_policy import FAILURE_CAUSES
from rerankit.engine.shards import cut, merge
from rerankit.errors import Cancelled, InvalidRequest, ModelLoadError, RerankitError, ReplicaDied
from rerankit.schema import ScoreRequest, ScoreResponse

log = logging.getLogger("rerankit.replicas")

STOP_POLL_S = 0.05  # how often a waiting call asks ``should_stop``
CLOSE_TIMEOUT_S = 10.0  # a replica that has not exited this long after being told to stop is killed
# ``replica_timeout_s``: a replica holding work that sends no reply this long is taken as hung (a stopped process,
# a hung device): killed, restarted, its work retried elsewhere. Off by default: a replica sends nothing while a
# call runs, and one call may take minutes (thousands of long documents on a large model).
REPLICA_TIMEOUT_S: float | None = None
__all__ = ["FAILURE_CAUSES", "DataParallelBackend", "ReplicaStatus", "replica_devices", "spare_replicas"]


def replica_devices(device: str | None, data_parallel_size: int | str) -> list[str]:
    """The device of each replica: ``cuda:0..N-1`` on GPUs (``"auto"``: every visible one), ``cpu`` N times."""
    import torch

    kind = (device or ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
    visible = torch.cuda.device_count() if kind == "cuda" else 1
    if data_parallel_size == "auto":
        size = visible
    elif isinstance(data_parallel_size, int) and not isinstance(data_parallel_size, bool) and data_parallel_size >= 1:
        size = data_parallel_size
    else:
        raise InvalidRequest("data_parallel_size", f"must be an int >= 1 or 'auto', got {data_parallel_size!r}")
    if kind == "cuda":
        if size > visible:
            raise InvalidRequest("data_parallel_size", f"asks for {size} replicas but {visible} GPUs are visible")
        return [f"cuda:{index}" for index in range(size)]
    if kind != "cpu":
        raise InvalidRequest("device", f"data parallel runs on 'cuda' or 'cpu', got {device!r}")
    return ["cpu"] * size


def spare_replicas(replicas: list[Replica]) -> int:
    """How many replicas a call's requests are cut across: those running with room for another task (fewer tasks in
    flight than they run at once), at least 1. A replica busy to the full takes whole requests: a cut would not
    start its part any sooner, and each part pays a call's fixed cost (tokenizing, launches, the prefix again)."""
    return max(1, sum(replica.state == "ready" and len(replica.tasks) < replica.pipelined_calls
                      for replica in replicas))


class DataParallelBackend:
    """Scores requests on ``data_parallel_size`` replicas of an ``EmbeddedBackend``, one process per device.

    ``device="cuda"`` puts replica i on ``cuda:i`` (``data_parallel_size="auto"``: every visible GPU);
    ``device="cpu"`` runs N CPU processes that share the cores. Other options go to each replica's
    ``EmbeddedBackend``. Replicas load in parallel; the constructor returns once every one is ready, and fails if
    one is not within ``startup_timeout_s`` seconds. A later start (a restart) still loading that long is killed.
    """

    def __init__(self, model: str, *, data_parallel_size: int | str = "auto", device: str | None = None,
                 startup_timeout_s: float = 600.0, replica_timeout_s: float | None = REPLICA_TIMEOUT_S,
                 **engine_options: Any) -> None:
        devices = replica_devices(device, data_parallel_size)
        self._model = model
        self._replica_timeout_s = replica_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._started = False  # the constructor returned: a failed load or a slow start is then a failure to restart
        self._options = {"show_progress": False, **engine_options}
        self._threads = max(1, (os.cpu_count() or 1) // len(devices)) if devices[0] == "cpu" else None
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._task_ids = itertools.count()
        self._closing = False
        self._model_name = model
        self._max_length = 0  # set by the first replica ready, before the constructor returns
        self._replicas = [Replica(index, device) for index, device in enumerate(devices)]
        with self._lock:
            for replica in self._replicas:
                self._start(replica)
        self._collector = threading.Thread(target=self._collect_forever, name="rerankit-replicas", daemon=True)
        self._collector.start()
        # One never closed is closed as the interpreter exits, before multiprocessing's own exit handler ends its
        # processes (atexit runs the newest first): else they would be taken for dead and restarted.
        atexit.register(_close_at_exit, weakref.ref(self))
        self._wait_until_ready(startup_timeout_s)

    @property
    def model_name(self) -> str:
        """The model the replicas score with, as they report it."""
        return self._model_name

    @property
    def max_length(self) -> int:
        """The longest sequence (query, item and template) the model takes, as the replicas report it."""
        return self._max_length

    @property
    def data_parallel_size(self) -> int:
        """How many replicas there are (ready, starting or down)."""
        return len(self._replicas)

    @property
    def pipelined_calls(self) -> int:
        """Calls that keep every replica busy: each replica's own (2 on a GPU, where one call launches while another
        one's scores come back; 1 on the CPU), summed."""
        return sum(replica.pipelined_calls for replica in self._replicas)

    @property
    def replica_pids(self) -> list[int | None]:
        """The process id of each replica while its process runs (a restarted replica has a new one), else None:
        a replica that is down, or one whose process has ended and is not restarted yet."""
        with self._lock:
            return [replica.pid for replica in self._replicas]

    def replica_status(self) -> list[ReplicaStatus]:
        """Each replica's state, process id, restarts, failures by cause and, while it is down, the seconds until
        it is started once more, as they are now."""
        with self._lock:
            return [replica.status() for replica in self._replicas]

    @property
    def startup_seconds(self) -> list[float | None]:
        """How long each replica's latest start took, from spawn to ready (interpreter, imports, model), in s."""
        return [replica.startup_seconds for replica in self._replicas]

    def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score every item of ``request``; one result per item, in input order."""
        return self.score_batch([request])[0]  # type: ignore[return-value]

    async def ascore(self, request: ScoreRequest) -> ScoreResponse:
        """``score`` on a worker thread, so the event loop keeps running (and other calls reach other replicas).
        Cancelling the awaiting task stops the call (``score_batch``'s ``should_stop``)."""
        return await score_cancellably(self.score_batch, request)

    def score_batch(self, requests: list[ScoreRequest], *, return_exceptions: bool = False,
                    should_stop: Callable[[], bool] | None = None) -> list[ScoreResponse | RerankitError]:
        """Score several requests across the replicas; one response per request, in order.

        A request the engine refuses raises its error (``return_exceptions``: the error takes its place); an error
        of a whole replica call raises for the call. ``should_stop`` is asked before each dispatch and while the
        call waits; once it says True the call raises ``Cancelled`` (work already sent finishes and is dropped).
        """
        tasks: list[tuple[Task, list[int]]] = []  # each task and the positions in ``shards`` of its requests
        with self._lock:
            shards = cut(requests, spare_replicas(self._replicas))
            planned = {replica.index: replica.load for replica in self._replicas}
            grouped: dict[int, list[int]] = {}
            for number in sorted(range(len(shards)), key=lambda n: -shards[n].tokens):
                target = self._least_loaded(planned)
                planned[target.index] += shards[number].tokens
                grouped.setdefault(target.index, []).append(number)
        for index, numbers in grouped.items():
            if should_stop is not None and should_stop():
                raise Cancelled("the caller stopped waiting before every part of the call was sent")
            numbers.sort()
            task = Task(next(self._task_ids), "score", [shards[n].request_of(requests) for n in numbers],
                         sum(shards[n].tokens for n in numbers))
            with self._lock:  # a replica that went down since the plan: the least loaded instead
                replica = self._replicas[index]
                if replica.state == "down":
                    replica = self._least_loaded()
                self._send(task, replica)
            tasks.append((task, numbers))
        self._wait_for([task for task, _ in tasks], should_stop)
        outcomes: list[Any] = [None] * len(shards)
        for task, numbers in tasks:
            for number, outcome in zip(numbers, task.future.result()):
                outcomes[number] = outcome
        merged = merge(requests, shards, outcomes)
        if not return_exceptions:
            for outcome in merged:
                if isinstance(outcome, BaseException):
                    raise outcome
        return merged

    def warm_up(self, shapes: list[tuple[int, int]] | None = None) -> float:
        """Warm every replica up at once (``EmbeddedBackend.warm_up``, with ``shapes``); returns the seconds the
        slowest took."""
        with self._lock:
            running = [replica for replica in self._replicas if replica.state != "down"]
            if not running:
                raise ReplicaDied("no replica is running: every one failed to start or died too often")
            tasks = [Task(next(self._task_ids), "warm_up", shapes, 0) for _ in running]
            for task, replica in zip(tasks, running):
                self._send(task, replica)
        self._wait_for(tasks, None)
        return max(task.future.result() for task in tasks)

    def problem(self) -> str | None:
        """None while a replica is ready; else why none is (a server's ``/health`` answers 503 with it). While
        every replica still running is restarting, work waits for the first of them to load."""
        with self._lock:
            if self._closing:
                return "the backend is closed"
            if all(replica.state == "down" for replica in self._replicas):
                return "no replica is running: every one failed to start or died too often"
            if not any(replica.state == "ready" for replica in self._replicas):
                starting = sum(replica.state == "starting" for replica in self._replicas)
                down = len(self._replicas) - starting
                return (f"no replica is ready: {starting} restarting (loading the model)"
                        + (f", {down} down" if down else ""))
        return None

    def close(self) -> None:
        """Stop every replica (killed if it has not exited within 10 s); later calls raise ``ModelLoadError``."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._ready.notify_all()
            for replica in self._replicas:
                replica.history.retry_at = None  # one that is down is not started again
                if replica.state == "starting" and replica.process is not None:
                    replica.process.kill()  # it holds no work: no need to wait for its model to load
                elif replica.state == "ready":  # (one waiting out the pause before its restart has no process)
                    replica.inbox.put(None)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for replica in self._replicas:
            if replica.process is not None:
                replica.process.join(max(0.0, deadline - time.monotonic()))
                if replica.process.is_alive():
                    replica.process.kill()
                    replica.process.join()
        self._collector.join(CLOSE_TIMEOUT_S)
        with self._lock:
            for replica in self._replicas:
                self._fail_all(replica, ModelLoadError("this DataParallelBackend is closed"))
                replica.close_channels()

    def __enter__(self) -> "DataParallelBackend":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Everything below runs with ``self._lock`` held unless it says otherwise.

    def _start(self, replica: Replica, delay_s: float = 0.0) -> None:
        """Start ``replica`` with a fresh inbox and pipe: its process now, or ``delay_s`` later (the collector)."""
        replica.renew(self._context, delay_s)
        if delay_s <= 0:
            self._spawn(replica)

    def _spawn(self, replica: Replica) -> None:
        options = {**self._options, "device": replica.device}
        replica.spawn(self._context.Process(target=replica_main, name=f"rerankit-replica-{replica.index}",
                                            args=(self._model, options, self._threads, replica.inbox,
                                                  replica.sender), daemon=True))

    def _least_loaded(self, planned: dict[int, int] | None = None, avoid: int | None = None) -> Replica:
        """The running replica with the least work (``planned``: its tasks as a plan counts them so far; None: its
        load now), ``avoid``'s only where it is the one left."""
        if planned is None:
            planned = {replica.index: replica.load for replica in self._replicas}
        candidates = [replica for replica in self._replicas if replica.state != "down"]
        if avoid is not None and len(candidates) > 1:
            candidates = [replica for replica in candidates if replica.index != avoid]
        # ready and still alive: a replica killed with another may not be seen dead yet (its retry would die too)
        ready = [replica for replica in candidates if replica.state == "ready" and replica.process.is_alive()]
        candidates = ready or candidates  # a restarting replica takes work only while none is ready
        if not candidates:
            raise ReplicaDied("no replica is running: every one failed to start or died too often")
        return min(candidates, key=lambda replica: (planned[replica.index], replica.index))

    def _send(self, task: Task, replica: Replica) -> None:
        if self._closing:
            task.future.set_exception(ModelLoadError("this DataParallelBackend is closed"))
            return
        if not replica.tasks:
            replica.last_progress = time.monotonic()
        replica.tasks[task.id] = task
        replica.inbox.put((task.kind, task.id, task.payload))

    def _wait_for(self, tasks: list[Task], should_stop: Callable[[], bool] | None) -> None:
        """Block (without the lock) until every task is answered; raise the first task's error as soon as it comes,
        and ``Cancelled`` once ``should_stop`` says so."""
        futures = [task.future for task in tasks]
        while True:
            done, pending = wait(futures, timeout=None if should_stop is None else STOP_POLL_S,
                                 return_when=FIRST_EXCEPTION)
            failed = [future.exception() for future in done if future.exception() is not None]
            if failed:
                raise failed[0]  # a failed task fails the call: the others' answers are dropped when they come
            if not pending:
                return
            if should_stop is not None and should_stop():
                raise Cancelled("the caller stopped waiting; the replicas' answers are dropped")

    def _wait_until_ready(self, timeout_s: float) -> None:
        """Block until every replica is ready; a replica that fails to load fails the constructor."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while any(replica.state == "starting" for replica in self._replicas):
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    break
                self._ready.wait(left)
            failed = self._load_error if any(replica.state != "ready" for replica in self._replicas) else None
            self._started = failed is None
        if failed is not None:
            self.close()
            raise failed

    @property
    def _load_error(self) -> RerankitError:
        late = f"not loaded within startup_timeout_s={self._startup_timeout_s:g} s (rerankit serve --startup-timeout)"
        reasons = dict.fromkeys(str(replica.failure or late) for replica in self._replicas if replica.state != "ready")
        failed = sum(replica.state != "ready" for replica in self._replicas)
        return ModelLoadError(f"{failed} of {len(self._replicas)} replicas of {self._model!r} did not start: "
                              + "; ".join(reasons))

    # The collector thread.

    def _collect_forever(self) -> None:
        """Read every replica's replies and watch its process until the backend closes."""
        while True:
            with self._lock:
                if self._closing:
                    return
                watched = {}
                for replica in self._replicas:
                    if replica.state != "down" and replica.process is not None:
                        watched[replica.replies] = replica
                        watched[replica.process.sentinel] = replica
                due = [at for replica in self._replicas for at in (replica.spawn_at, replica.history.retry_at)
                       if at is not None]
            timeout = min([0.5] + [max(0.0, at - time.monotonic()) for at in due])
            for ready in wait_ready(list(watched), timeout=timeout):
                replica = watched[ready]
                with self._lock:
                    if self._closing or replica.replies not in watched:  # restarted meanwhile
                        continue
                    if ready is replica.replies:
                        self._read(replica)
                    else:
                        self._drain(replica)
                        replica.process.join(1.0)  # its sentinel is ready as it ends: let the exit code settle
                        self._died(replica, f"exit code {replica.process.exitcode}")
            self._watch_clocks()

    def _watch_clocks(self) -> None:
        """Spawn a restart whose pause is over, and a replica that is down whose wait before its next try is;
        kill a ready replica that holds work and has sent no reply for ``replica_timeout_s`` (a hung device or
        process), and a restart still loading ``startup_timeout_s`` after its spawn (a stuck device, a hung file
        system). A killed replica's death is then handled as any other."""
        now = time.monotonic()
        with self._lock:
            for replica in self._replicas:
                if self._closing or replica.killed is not None:
                    continue
                if replica.state == "down":
                    if replica.history.retry_due(now):
                        replica.history.retry()
                        log.warning("replica %d on %s is down: starting it once more (restart %d)", replica.index,
                                    replica.device, replica.restarts)
                        self._start(replica)
                elif replica.spawn_at is not None:
                    if now >= replica.spawn_at:
                        self._spawn(replica)
                elif (replica.state == "ready" and replica.tasks and self._replica_timeout_s is not None
                        and now - replica.last_progress > self._replica_timeout_s):
                    log.error("replica %d on %s sent no reply for %.0f s holding %d task(s): killing it as hung",
                              replica.index, replica.device, now - replica.last_progress, len(replica.tasks))
                    replica.killed = "timed_out"  # once: its sentinel reports the death
                    replica.process.kill()
                elif (replica.state == "starting" and self._started
                        and now - replica.started_at > self._startup_timeout_s):
                    log.error("replica %d on %s is not ready %.1f s after its start: killing it", replica.index,
                              replica.device, now - replica.started_at)
                    replica.killed = "start_timed_out"
                    replica.process.kill()

    def _read(self, replica: Replica) -> None:
        try:
            message = replica.replies.recv()
        except (EOFError, OSError):
            replica.process.join(1.0)  # the pipe closes as the process ends; let the exit code settle
            self._died(replica, f"its pipe closed (exit code {replica.process.exitcode})")
            return
        self._handle(replica, message)

    def _drain(self, replica: Replica) -> None:
        """Handle the replies a dead replica sent before it died: work it finished is not done twice."""
        try:
            while replica.replies.poll():
                self._handle(replica, replica.replies.recv())
        except (EOFError, OSError):
            pass

    def _handle(self, replica: Replica, message: tuple) -> None:
        kind = message[0]
        replica.last_progress = time.monotonic()
        if kind == "ready":
            _, self._model_name, load_seconds, self._max_length, replica.pipelined_calls = message
            replica.state = "ready"
            replica.startup_seconds = time.monotonic() - replica.started_at
            log.info("replica %d on %s ready in %.1f s (model load %.1f s)", replica.index, replica.device,
                     replica.startup_seconds, load_seconds)
            self._ready.notify_all()
        elif kind == "load_failed":
            replica.failure = message[1]
            if self._started:  # a restart's load: its process ends now, a failure handled (and logged) as any other
                return
            log.error("replica %d on %s failed to load: %s", replica.index, replica.device, replica.failure)
            replica.failures["failed_to_start"] += 1  # the backend's start: it fails with this error
            replica.state = "down"
            self._retry_all(replica)
            self._ready.notify_all()
        else:
            _, task_id, payload = message
            task = replica.tasks.pop(task_id, None)
            if task is None or task.future.done():
                return
            if kind == "done":
                task.future.set_result(payload)
            else:
                task.future.set_exception(payload)

    def _died(self, replica: Replica, how: str) -> None:
        if replica.state == "down":
            return
        cause = ("timed_out" if replica.killed == "timed_out" else "failed_to_start"
                 if replica.state == "starting" or replica.killed == "start_timed_out" else "died")
        if replica.killed == "timed_out":
            how = f"killed after {self._replica_timeout_s:g} s without a reply, {how}"
        elif replica.killed == "start_timed_out":
            how = f"killed still loading {self._startup_timeout_s:g} s after its start, {how}"
        elif replica.state == "starting" and replica.failure is not None:
            how = f"its model failed to load: {replica.failure}; {how}"
        replica.killed = replica.failure = None
        delay_s = replica.history.fail(cause, time.monotonic())
        log.error("%s", ReplicaDied(f"replica {replica.index} on {replica.device} died ({how}) holding "
                                    f"{len(replica.tasks)} task(s); {replica.history.verdict(delay_s)}"))
        replica.close_channels()
        if delay_s is None:
            replica.state = "down"
        else:  # first, so that a lone replica can take its own work back
            self._start(replica, delay_s)
        self._retry_all(replica)

    def _retry_all(self, replica: Replica) -> None:
        """Send the tasks ``replica`` held to another replica (itself restarted if it is the only one), once;
        a task already retried fails."""
        held, replica.tasks = list(replica.tasks.values()), {}
        for task in held:
            if task.retried or task.kind != "score":
                task.future.set_exception(ReplicaDied(
                    f"replica {replica.index} on {replica.device} died with this work, "
                    + ("which had already been retried once" if task.retried else "during its warm-up")))
                continue
            task.retried = True
            try:
                target = self._least_loaded(avoid=replica.index)
            except ReplicaDied as error:
                task.future.set_exception(error)
                continue
            self._send(task, target)

    def _fail_all(self, replica: Replica, error: RerankitError) -> None:
        held, replica.tasks = list(replica.tasks.values()), {}
        for task in held:
            if not task.future.done():
                task.future.set_exception(error)


def _close_at_exit(backend: "weakref.ref[DataParallelBackend]") -> None:
    """``close`` a backend still alive (and not closed) as the interpreter exits."""
    alive = backend()
    if alive is not None:
        alive.close()

