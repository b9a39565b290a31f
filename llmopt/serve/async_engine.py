"""The engine behind an HTTP server: one thread steps the (single-threaded) Engine while any request is live;
requests and aborts reach it through a thread-safe queue, and each request gets its own asyncio stream of
RequestOutputs. A failing step fails the requests it was running, never the server; a loop that dies anyway (an
error outside any request's handling) is restarted in place, its engine reset, by the watchdog in `_run`: the
requests in flight end with an error naming the failure, and the server goes on.

The engine is built in that thread too (for `llmopt serve`, the model load as well): every torch operation of the
server then runs in one thread. With OpenMP (torch's CPU thread pool) each thread that runs a parallel region
keeps its own team of workers; a second team makes libgomp count more busy threads than cores and stop spinning
between regions, which made every decode step markedly slower (docs/results/code-figures.md#one-torch-thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from llmopt.core.errors import LLMOptError, ParallelError, ReplicaFailed, RequestsFailed
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class ServerOverloaded(LLMOptError):
    """More requests are waiting than the server accepts (--max-waiting): retry later."""


class EngineStopping(LLMOptError):
    """The server is shutting down: new requests are refused, and streams still running at the end of
    --shutdown-timeout end with this error."""


class EngineRestarted(LLMOptError):
    """The engine loop failed while this request was in flight and was restarted (the request is lost)."""


def engine_stopped(cause) -> EngineRestarted:
    """What a request gets once the engine cannot run again (the server is exiting)."""
    return EngineRestarted(f"the engine stopped ({cause}): the server is exiting")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed (the server is gone): nobody to tell
            pass


class AsyncEngine:
    def __init__(self, build_engine: Callable[[], Engine], max_waiting: int | None = None):
        """build_engine runs in the engine thread (see the module's note); start() waits for it."""
        self._build_engine = build_engine
        self.engine: Engine | None = None
        self.max_waiting = max_waiting
        self.restarts = 0  # times the watchdog restarted a loop that died
        self.failed: BaseException | None = None  # set when even a restart failed: the server must exit
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

    def unavailable(self) -> str | None:
        """Why this server cannot answer a request now (its engine stopped, or no worker of a role runs: one is
        starting again), else None: what /health reports."""
        if not self.alive:
            return f"engine stopped ({self.failed})" if self.failed is not None else "engine stopped"
        return self.engine.unavailable()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def drain(self, timeout: float) -> None:
        """A graceful shutdown: refuse new requests from now on (EngineStopping), let those in flight run, and end
        the ones still running after `timeout` seconds with EngineStopping (a final SSE error event, or a 503)."""
        self._stopping.set()
        self._wake.set()
        reason = f"the server shut down: this request was still running after its {timeout:g} s shutdown timeout"
        timer = threading.Timer(max(0.0, timeout), self.cut_streams, args=(reason,))
        timer.daemon = True
        timer.start()

    def cut_streams(self, reason: str) -> None:
        """End every request in flight now with EngineStopping(reason) (the end of a graceful shutdown)."""
        self._inbox.put(("cut", reason))
        self._wake.set()

    def _refuse_if_stopped(self) -> None:
        if self._stopping.is_set():
            raise EngineStopping("the server is shutting down: retry on another replica or after its restart")
        if not self.alive:
            raise engine_stopped(self.failed)

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self._pending

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended (their streams open): what a graceful shutdown waits for."""
        return len(self._streams) + self._pending

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def admit(self, count: int) -> None:
        """Refuse, before any is queued, `count` sequences of one request the server cannot take: more than it
        ever holds at once, running (--max-num-seqs) plus waiting (--max-waiting) (a ValueError: the request
        itself is too large), or more than it has room for now (ServerOverloaded: retry later)."""
        self._refuse_if_stopped()
        if self.max_waiting is None:
            return
        max_num_seqs = self.engine.config.max_num_seqs
        capacity = self.max_waiting + max_num_seqs
        if count > capacity:
            raise ValueError(f"{count} sequences in one request, more than the server holds at once "
                             f"(--max-num-seqs {max_num_seqs} running + --max-waiting {self.max_waiting} waiting)")
        held = self.num_waiting + self.num_running
        if held + count > capacity:
            raise ServerOverloaded(f"{self.num_running} requests are running and {self.num_waiting} waiting; this "
                                   f"one adds {count} (--max-num-seqs {max_num_seqs}, --max-waiting "
                                   f"{self.max_waiting})")

    # --- requests -------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine produces them; leaving the iteration early aborts the request."""
        self._refuse_if_stopped()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        admitted: concurrent.futures.Future = concurrent.futures.Future()
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(("add", prompt_ids, params, stream, admitted))
        self._wake.set()
        try:
            request_id = await asyncio.wrap_future(admitted)  # raises the engine's ConfigError for a bad request
        except asyncio.CancelledError:  # the caller left while the engine was adding it: abort it once added
            admitted.add_done_callback(self._abort_once_added)
            raise
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

    def _abort_once_added(self, admitted: concurrent.futures.Future) -> None:
        if not admitted.cancelled() and admitted.exception() is None:
            self._inbox.put(("abort", admitted.result()))
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
            except ParallelError:  # the engine is gone (see _handle): the loop ends
                raise
            except Exception:  # noqa: BLE001  (a message that fails is that request's problem, never the loop's)
                log.exception("a request message failed in the engine thread")

    def _handle(self, message: tuple) -> None:
        if message[0] == "abort":
            self.engine.abort(message[1])
            return
        if message[0] == "cut":
            self._fail_all(EngineStopping(message[1]))
            return
        _, prompt_ids, params, stream, admitted = message
        with self._pending_lock:
            self._pending -= 1
        # a request whose caller went away before it was added (its future cancelled: a sibling of an n > 1
        # request was refused, the client hung up) is dropped; once running, the future can no longer be cancelled
        if not admitted.set_running_or_notify_cancel():
            return
        if self._stopping.is_set():
            admitted.set_exception(EngineStopping("the server is shutting down: retry after its restart"))
            return
        try:
            request_id = self.engine.add_request(prompt_ids, params)
        except ReplicaFailed as exc:  # no worker of a role runs now (one is starting again): retry shortly
            admitted.set_exception(EngineRestarted(str(exc)))
            return
        except ParallelError as exc:  # every worker of a role is gone for good: this engine cannot serve again
            admitted.set_exception(engine_stopped(exc))
            raise
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
        while True:  # the watchdog: a loop that dies is restarted, never left a zombie behind a live server
            try:
                self._serve()
                return
            except ParallelError as exc:  # a rank is gone: the engine cannot run again
                self.failed = exc
                log.critical("the engine stopped: %s", exc)
                return
            except BaseException as exc:  # noqa: BLE001
                self.restarts += 1
                log.critical("the engine loop died (%s: %s); restarting it (restart %d); the requests in flight "
                             "fail", type(exc).__name__, exc, self.restarts, exc_info=True)
                try:
                    self._restart(exc)
                except BaseException as again:  # noqa: BLE001  (no way to go on: /health 503, the CLI exits 1)
                    self.failed = again
                    log.critical("restarting the engine failed: %s", again, exc_info=True)
                    return

    def _restart(self, exc: BaseException) -> None:
        """Fail every request in flight with EngineRestarted and reset the engine to no requests."""
        failure = EngineRestarted(f"the engine failed while running this request ({type(exc).__name__}: {exc}) "
                                  f"and was restarted: send it again")
        for stream in self._streams.values():
            stream.put(failure)
        self._streams.clear()
        self.engine.reset()

    def _serve(self) -> None:
        while True:
            self._wake.clear()  # before draining: a request put after the drain sets it again (no lost wake-up)
            try:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self.engine.poll()  # (a worker of a multi-process front that died or is ready again)
            except ParallelError as exc:  # fatal: fail the requests, end the loop (/health 503, the CLI exits 1)
                self._fail_streams(engine_stopped(exc))
                raise
            if self._stopping.is_set() and not self.engine.has_unfinished():
                return
            if not self.engine.has_unfinished():
                self._wake.wait(0.1)
                continue
            try:
                outputs = self.engine.step()
            except RequestsFailed as exc:  # some requests failed alone (a data-parallel replica died): only those
                for request_id, error in exc.errors.items():
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put(EngineRestarted(str(error)) if isinstance(error, ReplicaFailed) else error)
                continue
            except ParallelError as exc:  # fatal (every rank is stopped): fail the requests, end the loop
                self._fail_streams(exc)
                raise
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

    def _fail_streams(self, exc: Exception) -> None:
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()

    def _fail_all(self, exc: Exception) -> None:
        failure = exc if isinstance(exc, LLMOptError) else RuntimeError(
            f"the engine failed while running this request: {exc}")
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(failure)
        self._streams.clear()
        while self.engine.has_unfinished():  # collect the aborted requests' final outputs
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001
                break
