"""The stream runtime: ordered device work, events, asynchronous host<->device copies.

On CUDA a ``Stream`` wraps a ``torch.cuda.Stream``: work is launched from the host thread and runs
asynchronously on the device. On CPU a worker thread plays the device: submitted callables run in
order on it while the host thread goes on scheduling (torch releases the GIL inside its ops).

Two debugging modes make host/device races visible on CPU:
- ``hazard_check``: a ``HostBuffer`` whose asynchronous copy has not completed raises
  ``HazardError`` (naming the buffer) when host code reads or rewrites it.
- ``delay``: the worker runs nothing until the host waits on an event, so every pending copy lands
  as late as possible and a host buffer rewritten too early is copied with the wrong contents,
  deterministically. On CUDA the stream spins for ``CUDA_COPY_DELAY_CYCLES`` before each
  asynchronous copy, so a copy from a host buffer lands well after the host has moved on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

CUDA_COPY_DELAY_CYCLES = 50_000_000  # ~25-35 ms at H100/A100 clocks: far longer than a host step


class DeviceWorkError(RuntimeError):
    """Work on the device timeline raised; reported at the host's next wait or submit."""


class HazardError(RuntimeError):
    """Host code touched a buffer while an asynchronous copy from or into it was pending."""


class Event:
    """Marks a point in a stream; ``wait`` blocks the host until the stream has passed it."""

    def __init__(self, stream: Stream, seq: int, cuda_event=None):
        self.stream = stream
        self.seq = seq
        self._cuda_event = cuda_event

    def query(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()
        return self.stream._done_seq >= self.seq

    def wait(self) -> None:
        self.stream.num_host_waits += 1
        start = time.perf_counter()
        try:
            if self._cuda_event is not None:
                self._cuda_event.synchronize()
            else:
                self.stream._wait_for(self.seq)
        finally:
            self.stream.host_wait_seconds += time.perf_counter() - start


# The CPU device timeline's worker thread (a profile's trace names it after this; the host thread that
# schedules is the caller's own).
DEVICE_THREAD_NAME = "refengine-device"


class Stream:
    def __init__(self, device: torch.device, *, delay: bool = False, hazard_check: bool = False):
        self.device = torch.device(device)
        self.delay = delay
        self.hazard_check = hazard_check
        self.num_host_waits = 0  # device->host synchronisations, for stats
        self.host_wait_seconds = 0.0  # time the host spent blocked in those waits, for stats
        self._busy_seconds = 0.0  # device time of submitted work (see busy_seconds)
        self._intervals: list = []  # CUDA: (start, end) events around each submitted program, not yet summed
        self._seq = 0
        self._done_seq = 0
        self._released_seq = 0 if delay else float("inf")
        self._error: BaseException | None = None
        self._discarded_through = (
            0  # CPU: queued work up to this sequence number is skipped (see _raise_if_failed)
        )
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._closed = False
        if self.device.type == "cuda":
            self._cuda_stream = torch.cuda.Stream(device=self.device)
            self._thread = None
        else:
            self._cuda_stream = None
            self._thread = threading.Thread(target=self._run, name=DEVICE_THREAD_NAME, daemon=True)
            self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The operating system's id of the CPU device timeline's worker thread (None on CUDA), as a
        profiler's trace names threads."""
        return None if self._thread is None else self._thread.native_id

    # ---- submitting work ----------------------------------------------------------------------
    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the device timeline, after everything submitted before it."""
        if self._cuda_stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._cuda_stream):
                start.record(self._cuda_stream)
                fn()
                end.record(self._cuda_stream)
            self._intervals.append((start, end))
            if len(self._intervals) > 256:  # fold finished intervals so a long run keeps few events
                while self._intervals and self._intervals[0][1].query():
                    a, b = self._intervals.pop(0)
                    self._busy_seconds += a.elapsed_time(b) / 1000.0
            return
        with self._cv:
            self._raise_if_failed()
            self._seq += 1
            self._queue.append((self._seq, fn))
            self._cv.notify_all()

    def record_event(self) -> Event:
        if self._cuda_stream is not None:
            ev = torch.cuda.Event()
            ev.record(self._cuda_stream)
            return Event(self, 0, ev)
        self.submit(lambda: None)
        return Event(self, self._seq)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, host: HostBuffer | None = None) -> Event | None:
        """Asynchronous copy ``src -> dst``; ``host`` is the host-side buffer, pending until the event (the
        copy's own; without ``host`` none is recorded: the caller marks its buffer pending until a later
        event, such as its step's)."""
        if self._cuda_stream is not None:
            with torch.cuda.stream(self._cuda_stream):
                if self.delay:
                    torch.cuda._sleep(CUDA_COPY_DELAY_CYCLES)  # the copy lands late, deterministically
                dst.copy_(src, non_blocking=True)
            event = self.record_event() if host is not None else None
        else:
            self.submit(lambda: dst.copy_(src))
            event = Event(self, self._seq)
        if host is not None:
            host.pending = event
        return event

    def synchronize(self) -> None:
        self.record_event().wait()

    def busy_seconds(self) -> float:
        """Device time spent in submitted work so far: CUDA event pairs around each program on a GPU,
        the worker thread's time inside submitted work on CPU. Waits for the work in flight."""
        self.synchronize()
        if self._intervals:
            self._busy_seconds += sum(a.elapsed_time(b) for a, b in self._intervals) / 1000.0
            self._intervals.clear()
        return self._busy_seconds

    def close(self) -> None:
        if self._thread is None:
            return
        with self._cv:
            self._closed = True
            self._released_seq = float("inf")
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ---- the CPU worker -------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():  # CPU device work runs in the mode of the steps (Engine._inference_mode)
            while True:
                with self._cv:
                    while not self._closed and not (self._queue and self._queue[0][0] <= self._released_seq):
                        self._cv.wait()
                    if self._closed and not self._queue:
                        return
                    seq, fn = self._queue.popleft()
                start = time.perf_counter()
                try:
                    if self._error is None and seq > self._discarded_through:
                        fn()
                except BaseException as e:  # noqa: BLE001 - surfaced on the host at the next wait or submit
                    self._error = e
                self._busy_seconds += time.perf_counter() - start
                with self._cv:
                    self._done_seq = seq
                    self._cv.notify_all()

    def _wait_for(self, seq: int) -> None:
        with self._cv:
            if self.delay:
                self._released_seq = max(self._released_seq, seq)
                self._cv.notify_all()
            while self._done_seq < seq:
                self._cv.wait()
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        """Called with the lock held. Work queued before the host learns of a failure depended on the
        failed work: none of it runs, also after the error is reported (only later submissions do)."""
        if self._error is not None:
            self._discarded_through = self._seq  # before the error is cleared: the worker reads both unlocked
            err, self._error = self._error, None
            raise DeviceWorkError(f"device work failed: {err!r}") from err


class HostBuffer:
    """A host staging tensor with a name; guarded against use while its copy is pending."""

    def __init__(self, name: str, stream: Stream, shape, dtype: torch.dtype):
        self.name = name
        self.stream = stream
        self.tensor = torch.empty(shape, dtype=dtype, pin_memory=stream.device.type == "cuda")
        self.pending: Event | None = None
        self._array = None  # numpy view of ``tensor``, made at first use
        self._rows: dict[int, torch.Tensor] = {}  # n -> tensor[:n], made at first use

    def _check(self, action: str) -> None:
        if self.pending is not None and not self.pending.query():
            if self.stream.hazard_check:
                raise HazardError(
                    f"host buffer {self.name!r} {action} while its asynchronous copy is pending"
                )
            return
        self.pending = None

    def write(self, values) -> torch.Tensor:
        """Overwrite the leading entries with ``values``; returns the written view."""
        self._check("rewritten")
        values = torch.as_tensor(values, dtype=self.tensor.dtype)
        view = self.tensor[: values.shape[0]]
        if values.dim() == 2:
            view = view[:, : values.shape[1]]
        view.copy_(values)
        return view

    def read(self) -> torch.Tensor:
        self._check("read")
        return self.tensor

    def reuse(self) -> None:
        """Take the buffer for another step: its earlier copy must be done (the host waited on that step
        already; with hazard checking a pending one raises, else it is waited for)."""
        if self.pending is not None and not self.pending.query():
            if self.stream.hazard_check:
                raise HazardError(f"host buffer {self.name!r} reused while its asynchronous copy is pending")
            self.pending.wait()
        self.pending = None

    def at_least(self, numel: int) -> torch.Tensor:
        """The buffer, grown first to hold ``numel`` elements if it is smaller (a new allocation only then;
        a 1-D buffer)."""
        if numel > self.tensor.numel():
            pin = self.stream.device.type == "cuda"
            numel = max(numel, 2 * self.tensor.numel())
            self.tensor = torch.empty(numel, dtype=self.tensor.dtype, pin_memory=pin)
            self._array = None
            self._rows.clear()
        return self.tensor

    def rows(self, n: int) -> torch.Tensor:
        """``tensor[:n]``, the same view every time (no torch op per step)."""
        view = self._rows.get(n)
        if view is None:
            view = self._rows[n] = self.tensor[:n]
        return view

    @property
    def array(self):
        """A numpy view of the buffer (host writes without a torch op each)."""
        if self._array is None:
            self._array = self.tensor.numpy()
        return self._array


class HostRing:
    """Host staging buffers a step takes in turn (``take(step index)``), so none is allocated per step.

    Two suffice: step N's buffer is taken again by step N + 2, planned after the host waited on step N
    (processing step N comes before planning step N + 2), so its copies are done by then."""

    def __init__(self, name: str, stream: Stream, shape, dtype: torch.dtype, size: int = 2):
        self.name, self.stream, self.shape, self.dtype = name, stream, shape, dtype
        self._buffers: list[HostBuffer | None] = [None] * size  # allocated at first use

    def take(self, index: int) -> HostBuffer:
        i = index % len(self._buffers)
        buf = self._buffers[i]
        if buf is None:
            buf = self._buffers[i] = HostBuffer(f"{self.name}-{i}", self.stream, self.shape, self.dtype)
        buf.reuse()
        return buf

