"""The bench client (`llmopt bench --base-url`) against a server that closes each connection after its streamed
response without saying so, as llama.cpp's llama-server does: a kept-alive connection the client reuses is then
already closed, and the request goes once more on a new connection instead of failing the run."""

import socket
import threading

import pytest

from llmopt.eval.http_bench import run_http, server_timing
from llmopt.eval.workloads import BenchRequest

CHUNK = b'data: {"choices": [{"text": "x", "index": 0}]}\n\n'


def _answer(conn: socket.socket) -> None:
    with conn:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        while len(rest) < length:
            rest += conn.recv(65536)
        if head.startswith(b"GET"):
            body, kind = b'{"data": []}', b"application/json"
        else:
            body, kind = CHUNK * 2 + b"data: [DONE]\n\n", b"text/event-stream"
        # no "Connection: close": the client takes the connection for reusable, then it is gone
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_a_connection_closed_after_each_response_costs_a_retry_not_the_run():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    answered, stop = [], threading.Event()

    def serve():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:  # (the accept timeout: look at `stop` again)
                continue
            conn.settimeout(10)
            _answer(conn)
            answered.append(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        # 4 at once: the second wave finds up to 4 dead connections in the pool
        requests = [BenchRequest([1, 2, 3], max_tokens=2) for _ in range(12)]
        records, _ = run_http(f"http://127.0.0.1:{port}/v1", "completions", "m", requests, tokenizer=None,
                              max_concurrency=4)
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()
    assert len(records) == 12 and all(len(r.token_times) == 2 for r in records)
    assert len(answered) >= 13  # GET /models, then each request on its own connection


def test_server_timing_reads_one_metrics_duration_in_seconds():
    assert server_timing("ttft;dur=412.5", "ttft") == pytest.approx(0.4125)
    assert server_timing('db;dur=3, ttft;desc="first token";dur="7.25"', "ttft") == pytest.approx(0.00725)
    assert server_timing("db;dur=3", "ttft") is None  # another metric only
    assert server_timing("ttft", "ttft") is None  # no duration
    assert server_timing("ttft;dur=soon", "ttft") is None
    assert server_timing("", "ttft") is None
