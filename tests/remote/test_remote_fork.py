"""A process forked after the remote backend was used (gunicorn --preload, multiprocessing's 'fork', Celery's
prefork) gets its own replies and its own threads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import rerankit


FORKED = """
    import json, os, sys, threading, time, signal
    from concurrent.futures import ThreadPoolExecutor
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from rerankit import Reranker, ScoreRequest

    class Handler(BaseHTTPRequestHandler):  # Cohere /v2/rerank; each score tells which query it answers
        protocol_version = "HTTP/1.1"  # keep-alive: the client pools its connections
        disable_nagle_algorithm = True  # head and body are two writes: Nagle + delayed ACK held each reply ~40 ms
        def log_message(self, *args): pass
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            number = int(body["query"].split()[-1])
            time.sleep(0.002)
            raw = json.dumps({"results": [{"index": i, "relevance_score": number + i / 100}
                                          for i in range(len(body["documents"]))]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    reranker = Reranker(url, dialect="cohere", served_model="m", deadline=10)
    split = Reranker(url, dialect="cohere", served_model="m", deadline=5, max_items_per_request=1)

    def request(number):
        return ScoreRequest(query=f"query {number}", items=["a", "b", "c"])

    with ThreadPoolExecutor(8) as pool:  # several pooled keep-alive connections, and split's 8 threads
        list(pool.map(lambda n: reranker.score(request(n)), range(32)))
    split.score(ScoreRequest(query="query 0", items=[f"d{i}" for i in range(16)]))

    def check(number):
        wrong = []
        for _ in range(40):
            try:
                scores = reranker.score(request(number)).scores
                if scores != [number, number + 0.01, number + 0.02]:
                    wrong.append(f"scores {scores} for query {number}")
            except Exception as exc:
                wrong.append(f"{type(exc).__name__}: {exc}"[:200])
        try:  # a split call: the parent's threads were not copied
            split.score(ScoreRequest(query=f"query {number}", items=[f"d{i}" for i in range(16)]))
        except Exception as exc:
            wrong.append(f"split: {type(exc).__name__}: {exc}"[:200])
        return wrong

    children = []
    for number in range(1, 4):
        pid = os.fork()
        if pid == 0:
            wrong = check(number)
            print(f"child {number}:", wrong[:3], flush=True)
            os._exit(1 if wrong else 0)
        children.append(pid)
    wrong = check(0)
    print("parent:", wrong[:3], flush=True)
    failed = bool(wrong)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        failed |= os.waitstatus_to_exitcode(status) != 0
    sys.exit(1 if failed else 0)
"""


def test_processes_forked_after_use_get_their_own_replies():
    # Before: the children used the parent's pooled sockets, so replies went to the wrong process (another
    # query's scores, accepted when the item counts matched; 400s; bodies that were not JSON), and split calls
    # waited out their deadline for threads that fork had not copied.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(rerankit.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(FORKED)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
