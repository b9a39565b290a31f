"""The engine behind an HTTP server: one thread steps the (single-threaded) Engine while any request is live;
requests and aborts reach it through a thread-safe queue, and each request gets its own asyncio stream of
RequestOutputs. A failing step fails the requests it was running, never the server.

The engine is built in that thread too (for `llmopt serve`, the model load as well): every torch operation of the
server then runs in one thread. With OpenMP (torch's CPU thread pool) each thread that runs a parallel region
keeps its own team of workers; a second team makes libgomp count more busy threads than cores and stop spinning
between regions, which made every decode step ~1.5x slower on a 2-core machine (36 vs 23 ms per token)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from llmopt.core.errors import LLMOptError
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class ServerOverloaded(LLMOptError):
    """More requests are waiting than the server accepts (--max-waiting): retry later."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, build_engine: Callable[[], Engine], max_waiting: int | None = None):
        """build_engine runs in the engine thread (see the module's note); start() waits for it."""
        self._build_engine = build_engine
        self.engine: Engine | None = None
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._pending = 0  # submitted, not yet added (counted toward max_waiting)
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and wait until its engine is built (re-raising what building it raised)."""
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(built,), name="llmopt-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()

    def stop(self, timeout: float | None = None) -> None:
        """Stop stepping (after in-flight requests finish, or abort them when `timeout` runs out)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def admit(self, count: int) -> None:
        """Refuse, before any is queued, `count` sequences of one request that --max-waiting cannot take: more than
        it ever queues at once (a ValueError: the request itself is too large), or more than it has room for now
        (ServerOverloaded: retry later)."""
        if not self.alive:
            raise ServerOverloaded("the engine is shutting down")
        if self.max_waiting is None:
            return
        if count > self.max_waiting:
            raise ValueError(f"{count} sequences in one request, more than the server queues at once "
                             f"(--max-waiting {self.max_waiting})")
        if self.num_waiting + count > self.max_waiting:
            raise ServerOverloaded(f"{self.num_waiting} requests are waiting and this one adds {count} "
                                   f"(--max-waiting {self.max_waiting})")

    # --- requests -------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them; leaving the iteration early aborts the request."""
        if not self.alive:
            raise ServerOverloaded("the engine is shutting down")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise ServerOverloaded(f"{self.num_waiting} requests are waiting (--max-waiting {self.max_waiting})")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(("add", prompt_ids, params, stream, admitted))
        self._wake.set()
        request_id = await asyncio.wrap_future(admitted)  # raises the engine's ConfigError for a bad request
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the client went away, or the caller stopped reading
                self._inbox.put(("abort", request_id))
                self._wake.set()

    # --- the engine thread ----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001  (a message that fails is that request's problem, never the loop's)
                log.exception("a request message failed in the engine thread")

    def _handle(self, message: tuple) -> None:
        if message[0] != "add":
            self.engine.abort(message[1])
            return
        _, prompt_ids, params, stream, admitted = message
        with self._pending_lock:
            self._pending -= 1
        # a request whose caller went away before it was added (its future cancelled: a sibling of an n > 1
        # request was refused, the client hung up) is dropped; once running, the future can no longer be cancelled
        if not admitted.set_running_or_notify_cancel():
            return
        try:
            request_id = self.engine.add_request(prompt_ids, params)
        except Exception as exc:  # noqa: BLE001  (a bad request fails alone)
            admitted.set_exception(exc)
            return
        self._streams[request_id] = stream
        admitted.set_result(request_id)

    def _run(self, built: concurrent.futures.Future) -> None:
        try:
            engine = self._build_engine()
        except BaseException as exc:  # noqa: BLE001  (start() re-raises it in the caller)
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(engine)
        self._serve()

    def _serve(self) -> None:
        while True:
            self._wake.clear()  # before draining: a request put after the drain sets it again (no lost wake-up)
            self._drain_inbox()
            if self._stopping.is_set() and not self.engine.has_unfinished():
                return
            if not self.engine.has_unfinished():
                self._wake.wait(0.1)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001  (fail the running requests, keep serving)
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                if stream is not None:
                    stream.put(output)

    def _fail_all(self, exc: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(RuntimeError(f"the engine failed while running this request: {exc}"))
        self._streams.clear()
        while self.engine.has_unfinished():  # collect the aborted requests' final outputs
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001
                break
