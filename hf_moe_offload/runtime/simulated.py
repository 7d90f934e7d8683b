"""`SimulatedRuntime`: an asynchronous device on the CPU, for testing the CUDA ordering without a GPU.

- The compute stream runs inline on the calling thread; every other stream is a worker thread that runs its
  operations in order, each after a seeded random delay (`max_delay`) plus whatever `delay_fn(stream, op)` adds.
- `copy_` fills its destination with NaN when it is enqueued and copies only when its stream reaches it, so a read
  that does not wait for the copy sees NaN.
- Every stream and the host carry a vector clock. Enqueuing ticks the stream's clock (and orders it after the host's
  past); `record` snapshots a clock into an event; `wait_event` / `Event.synchronize` merge it. Each declared access
  to a buffer (`access`, the operands of `copy_`, an allocation) is checked against the buffer's last write and
  reads (tracked by the bytes it covers: tensors in one storage, e.g. records of one host-tier block, conflict only
  where they overlap): a read must come after the last write, a write after the last write and every read; otherwise
  `HappensBeforeError` names the buffer, both streams and the fix. The check runs at enqueue time, so it does not
  depend on the delays: a missing edge fails every run, not one in a thousand.
- Device buffers from `empty(stream=s)` count as written by `s`; read on another stream `t`, they need
  `record_stream(buffer, t)` first (the caching-allocator rule) unless allocated `persistent=True`, whose owner
  declares their end with `free(buffer)`: by then every use on a stream other than `s` must be ordered before the host.
- Host threads share one clock (they synchronize among themselves with Python locks and futures, which the store's
  own tests cover); what is checked is device-stream against device-stream and device-stream against host.

Operations that raise on a worker are re-raised by the next `synchronize`, `run_on` or `check()`.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import threading
import time
import weakref
from collections.abc import Callable

import torch

from . import base
from .base import HOST, DeviceRuntime, Event, HappensBeforeError

_BASE_FILE = base.__file__

Clock = dict[str, int]


def _merge(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


class _Stream:
    def __init__(self, runtime: "SimulatedRuntime", name: str, worker: bool):
        self.name = name
        self.clock: Clock = {}
        self.rng = random.Random(f"{runtime.seed}:{name}")
        self.thread: threading.Thread | None = None
        self.done_pos = 0  # position of the last operation the worker finished
        if worker:
            self.queue: queue.Queue = queue.Queue()
            self.thread = threading.Thread(target=runtime._work, args=(self,), name=f"sim-{name}", daemon=True)
            self.thread.start()

    def __repr__(self) -> str:
        return f"<simulated stream {self.name}>"


class _SimEvent(Event):
    def __init__(self, runtime: "SimulatedRuntime", clock: Clock):
        self.runtime = runtime
        self.clock = clock
        self.done = threading.Event()
        self.t = 0.0

    def _fire(self) -> None:
        self.t = time.perf_counter()
        self.done.set()

    def synchronize(self) -> None:
        self.done.wait()
        self.runtime.check()
        with self.runtime._lock:
            _merge(self.runtime._host, self.clock)

    def query(self) -> bool:
        return self.done.is_set()


class _Buffer:
    __slots__ = ("ref", "span", "name", "alloc", "persistent", "recorded", "last_write", "reads", "where")

    def __init__(self, t: torch.Tensor, name: str, alloc: str | None, persistent: bool, track_views: bool = False):
        # Alive while the tensor object is, or with `track_views` while a view's base is (a read through a temporary
        # view, e.g. one record's row in an upload, is then remembered after the view object is gone).
        self.ref = weakref.ref(t if t._base is None or not track_views else t._base)
        self.span = _span(t)
        self.name = name
        self.alloc = alloc  # stream the block belongs to (None: not allocated by the runtime)
        self.persistent = persistent
        self.recorded: set[str] = set()
        self.last_write: tuple[str, int] | None = None
        self.reads: dict[str, int] = {}
        self.where = _declared_at()  # named in a conflict's message: which code declared this buffer

    def holds(self, key: int) -> bool:
        """Whether the memory at `key` is still the memory this record describes: the tensor it follows is alive and
        still over that memory (`set_` or a storage resize can move a live tensor off it, and the freed bytes may be
        handed to a new tensor, whose accesses must not be judged by this record's)."""
        t = self.ref()
        return t is not None and t.untyped_storage().data_ptr() == key


class SimulatedRuntime(DeviceRuntime):
    """See the module docstring. `seed` fixes the delays; `delay_fn(stream_name, op_name) -> seconds` adds more;
    `free_memory`: the device memory it reports free (None: unbounded). `track_views` (default): remember an access
    made through a view for as long as the view's base lives, not only while the view object does (catches a host
    write into bytes an upload read through a temporary view); an access then updates only the records within its
    bytes. False: the older, coarser tracking. A conflict's message names the code on each side."""

    name = "simulated"
    asynchronous = True

    def __init__(self, seed: int = 0, max_delay: float = 0.002,
                 delay_fn: Callable[[str, str], float] | None = None, free_memory: int | None = None,
                 track_views: bool = True):
        self.seed = seed
        self.track_views = track_views
        self._free_memory = free_memory
        self.max_delay = max_delay
        self.delay_fn = delay_fn
        self.device = torch.device("cpu")
        self._lock = threading.RLock()
        self._host: Clock = {"host": 0}
        self._streams: list[_Stream] = []
        self._compute = self._add_stream(worker=False)
        self._local = threading.local()
        # storage address -> the tensors in it that were declared (a host tier's layer block holds many records)
        self._buffers: dict[int, list[_Buffer]] = {}
        self._errors: list[BaseException] = []
        self.checks = 0  # declared accesses checked (tests assert the simulation actually looked)
        self.copies = 0

    def _add_stream(self, worker: bool) -> _Stream:
        with self._lock:
            s = _Stream(self, f"s{len(self._streams)}" if self._streams or worker else "compute", worker)
            self._streams.append(s)
            return s

    def free_memory(self) -> int | None:
        return self._free_memory

    # --- streams ---
    def current_stream(self):
        return getattr(self._local, "stream", None) or self._compute

    def new_stream(self):
        return self._add_stream(worker=True)

    def _resolve(self, stream) -> _Stream:
        return self.current_stream() if stream is None else stream

    def _tick(self, s: _Stream) -> int:
        """Enqueue one operation on `s`: it comes after the host's past; returns its position."""
        _merge(s.clock, self._host)
        s.clock[s.name] = s.clock.get(s.name, 0) + 1
        return s.clock[s.name]

    def _submit(self, s: _Stream, op: str, fn: Callable[[], None], pos: int = 0) -> None:
        if s.thread is None or threading.current_thread() is s.thread:
            fn()  # the compute stream (inline), or work a stream enqueues on itself
        else:
            s.queue.put((op, fn, pos))

    def _work(self, s: _Stream) -> None:
        self._local.stream = s
        while True:
            op, fn, pos = s.queue.get()
            delay = s.rng.random() * self.max_delay + (self.delay_fn(s.name, op) if self.delay_fn else 0.0)
            if delay > 0:
                time.sleep(delay)
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 (re-raised on the host)
                with self._lock:
                    self._errors.append(err)
            finally:
                s.done_pos = max(s.done_pos, pos)

    def check(self) -> None:
        """Raise the first error of an operation that ran on a worker stream."""
        with self._lock:
            if self._errors:
                err = self._errors.pop(0)
                raise err

    def run_on(self, stream, fn):
        """Run `fn` as work of `stream`: once the stream has reached this point (its earlier copies and waits ran),
        on the calling thread (so autograd's thread-local state, hooks and modes apply as on CUDA, where launching
        on a side stream stays on the calling thread), with `stream` current for what `fn` declares."""
        s = self._resolve(stream)
        if s.thread is None or threading.current_thread() is s.thread:
            return fn()
        with self._lock:
            pos = self._tick(s)
        reached = threading.Event()
        s.queue.put(("run_on", reached.set, pos))
        reached.wait()  # NOTE: waiting here orders nothing in the clocks: a CUDA launch would return at once
        self.check()
        previous = getattr(self._local, "stream", None)
        self._local.stream = s
        try:
            return fn()
        finally:
            self._local.stream = previous

    # --- events ---
    def record(self, stream=None):
        s = self._resolve(stream)
        with self._lock:
            pos = self._tick(s)
            event = _SimEvent(self, dict(s.clock))
        self._submit(s, "record", event._fire, pos)
        return event

    def wait_event(self, event, stream=None):
        if event is None:
            return
        s = self._resolve(stream)
        with self._lock:
            pos = self._tick(s)
            _merge(s.clock, event.clock)
        if s.thread is None:
            event.done.wait()  # the inline compute stream: the calling thread is the stream
            self.check()
        else:
            self._submit(s, "wait", event.done.wait, pos)

    # --- memory ---
    def empty(self, shape, dtype, stream=None, persistent=False):
        s = self._resolve(stream)
        t = torch.empty(shape, dtype=dtype)
        _poison(t)
        with self._lock:
            pos = self._tick(s)
            info = _Buffer(t, f"buffer{tuple(t.shape)}/{str(dtype).removeprefix('torch.')}", s.name, persistent)
            info.last_write = (s.name, pos)
            self._buffers[t.untyped_storage().data_ptr()] = [info]
        return t

    def free(self, tensor):
        with self._lock:
            self.checks += 1
            info = self._info(tensor)
            uses = list(info.reads.items()) + ([info.last_write] if info.last_write else [])
            for who, pos in uses:
                if who not in (info.alloc, "host") and self._host.get(who, 0) < pos:
                    raise HappensBeforeError(
                        f"{info.name} is freed while its use on {who} may still run: the allocator could hand its "
                        f"memory to stream {info.alloc} at once; synchronize with {who} (an event recorded after that "
                        "use) first")

    def record_stream(self, tensor, stream):
        with self._lock:
            self._info(tensor).recorded.add(self._resolve(stream).name)

    def copy_(self, dst, src, stream=None):
        s = self._resolve(stream)
        with self._lock:
            pos = self._tick(s)
            own_read = self._info(dst).reads.get(s.name, 0)  # an earlier operation of this stream reads dst
            self._check(src, s.name, pos, write=False, clock=s.clock)
            self._check(dst, s.name, pos, write=True, clock=s.clock)
            self.copies += 1
        if s.thread is None:
            dst.copy_(src)
            return
        if own_read <= s.done_pos:
            _poison(dst)  # what a reader that did not wait sees until the copy has run
        # The pending copy holds the memory, not the caller's tensor objects (as record_stream does on CUDA).
        dst, src = dst.detach(), src.detach()

        def op():
            _poison(dst)
            dst.copy_(src)

        self._submit(s, "copy", op, pos)

    def access(self, tensor, write=False, stream=None):
        with self._lock:
            if stream is HOST:
                self._host["host"] += 1
                self._check(tensor, "host", self._host["host"], write, clock=self._host)
            else:
                s = self._resolve(stream)
                pos = self._tick(s)
                self._check(tensor, s.name, pos, write, clock=s.clock)

    def elapsed(self, start, end):
        return max(0.0, end.t - start.t)

    # --- the checks ---
    def _info(self, t: torch.Tensor) -> _Buffer:
        return self._infos(t)[0]

    def _infos(self, t: torch.Tensor) -> list[_Buffer]:
        """The declared tensors whose memory `t`'s overlaps: its own record first (made if new), then the others (a
        record's row and the whole record, two records of one block: only bytes shared are a conflict)."""
        key = t.untyped_storage().data_ptr()
        span = _span(t)
        alive = [b for b in self._buffers.get(key, ()) if b.holds(key)]  # freed memory's address is reused
        own = next((b for b in alive if b.span == span), None)
        if own is None:
            own = _Buffer(t, f"tensor{tuple(t.shape)}", None, True, self.track_views)
            alive.append(own)
        self._buffers[key] = alive
        return [own] + [b for b in alive if b is not own and b.span[0] < span[1] and span[0] < b.span[1]]

    def _check(self, t: torch.Tensor, who: str, pos: int, write: bool, clock: Clock) -> None:
        self.checks += 1
        if t.numel() == 0:
            # No bytes to order, and empty tensors share addresses: one (a partition without tokens) would meet
            # another's history.
            return
        infos = self._infos(t)

        def before(prior: tuple[str, int]) -> bool:
            return prior[0] == who or clock.get(prior[0], 0) >= prior[1]

        verb = "write" if write else "read"
        for info in infos:
            if info.last_write is not None and not before(info.last_write):
                raise HappensBeforeError(
                    f"{verb} of {info.name} on {who} is not ordered after its write on {info.last_write[0]}: wait "
                    f"for an event recorded after that write (wait_event / Event.synchronize) first ({info.name} "
                    f"declared at {info.where}; this {verb} at {_declared_at()})"
                )
            if write:
                for reader, rpos in info.reads.items():
                    if not before((reader, rpos)):
                        raise HappensBeforeError(
                            f"write of {info.name} on {who} is not ordered after its read on {reader}: the buffer is "
                            "reused while still in use; wait for an event recorded after that read first "
                            f"({info.name} declared at {info.where}; this write at {_declared_at()})"
                        )
            if (info.alloc is not None and not info.persistent and who not in (info.alloc, "host")
                    and who not in info.recorded):
                raise HappensBeforeError(
                    f"{info.name} was allocated for stream {info.alloc} and is used on {who} without "
                    "record_stream: the caching allocator could hand its memory out again while it is still in use"
                )
        start, end = infos[0].span
        for info in infos:
            # With `track_views` every record lives as long as its memory, so an access updates its own record and
            # those within its bytes only: a larger one (a run of rows an upload read at once) keeps its history for
            # its other bytes, and a later access to these bytes meets this access's record. Without it a view's
            # record dies with the view, and the larger records carry the access on (coarser: any of their bytes).
            if self.track_views and info is not infos[0] and not (start <= info.span[0] and info.span[1] <= end):
                continue
            if write:
                info.last_write, info.reads = (who, pos), {}
            else:
                info.reads[who] = pos


def _declared_at() -> str:
    """The first caller outside this runtime (file:line, function, thread): where a buffer was declared or used."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in (__file__, _BASE_FILE):
        frame = frame.f_back
    where = "?" if frame is None else (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
                                       f"{frame.f_code.co_name}")
    return f"{where} on thread {threading.current_thread().name}"


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range `t` covers in its storage."""
    start = t.storage_offset() * t.element_size()
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return start, start + extent * t.element_size()


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))


__all__ = ["SimulatedRuntime"]
