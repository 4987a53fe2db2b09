"""Background shard writer: extract hands a shard over and goes on with the next forward pass.

``submit`` copies the hidden states off the GPU into a reusable pinned host buffer on a side CUDA
stream (non-blocking, an event marks completion) and queues the shard; one writer thread waits
for the event and calls :meth:`ShardStore.write_shard`, then ``on_done(ShardInfo)`` or
``on_done(exception)``. With ``stage_only=True`` it calls :meth:`ShardStore.stage_shard` instead
and hands ``on_done`` the :class:`StagedShard`, for a caller that commits (or discards) it itself,
e.g. under the manifest's lock. At most ``max_pending`` shards are held in host memory; ``submit``
blocks only when that many are pending. CPU tensors are queued as they are (no copy): the caller
must not modify them until ``on_done`` runs. ``close`` waits for everything and re-raises the
first error (a write error or an exception raised by ``on_done``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from dflash_staged.store import ShardInfo, ShardStore, StagedShard

OnDone = Callable[[ShardInfo | StagedShard | BaseException], None]


class _PinnedPool:
    """Reusable pinned uint8 host buffers, so each shard does not pay for cudaHostAlloc."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf
            if self._free:  # drop the largest too-small one rather than hold it forever
                self._free.remove(max(self._free, key=torch.Tensor.numel))
        return torch.empty(int(nbytes * 1.25) + 4096, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class ShardWriter:
    """Write shards on a background thread; see the module docstring."""

    def __init__(self, store: ShardStore, max_pending: int = 2, stage_only: bool = False):
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.store = store
        self._write = store.stage_shard if stage_only else store.write_shard
        self._slots = threading.Semaphore(max_pending)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._pool = _PinnedPool()
        self._stream = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dflash-shard-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        epoch: int,
        job_id: int,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        cu_seqlens: torch.Tensor,
        sample_ids: torch.Tensor,
        on_done: OnDone,
        topk: tuple[torch.Tensor, ...] | None = None,
        hidden_scale: torch.Tensor | None = None,
    ) -> None:
        """Queue one shard (``topk``: the target's top-k ids, log-probabilities and tail's log-mass, for a
        store with them; ``hidden_scale``: the scales of FP8 ``hidden``, :mod:`dflash_staged.store.fp8`)."""
        if self._closed:
            raise RuntimeError("ShardWriter.submit after close")
        self._slots.acquire()
        try:
            tensors = [hidden, input_ids, loss_mask, cu_seqlens, sample_ids] + list(topk or ())
            tensors += [] if hidden_scale is None else [hidden_scale]
            extra = (len(topk or ()), hidden_scale is not None)
            event, buf = None, None
            if any(t.is_cuda for t in tensors):
                tensors, event, buf = self._to_host(tensors)
            self._queue.put((epoch, job_id, tensors, extra, event, buf, on_done))
        except BaseException:
            self._slots.release()
            raise

    def _to_host(self, tensors: list[torch.Tensor]):
        """Start device->pinned copies on a side stream; return host views, the done event, the buffer."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=next(t.device for t in tensors if t.is_cuda))
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + (n + 63) // 64 * 64)  # keep every view 64-byte aligned
        buf = self._pool.take(offsets[-1])
        host = []
        current = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(current)  # the producer's kernels must finish before the copy
        with torch.cuda.stream(self._stream):
            for t, off, n in zip(tensors, offsets, sizes):
                dst = buf[off : off + n].view(t.dtype).view(t.shape)
                if t.is_cuda:
                    t.record_stream(self._stream)  # keep the allocator from reusing t's memory early
                    dst.copy_(t.contiguous() if not t.is_contiguous() else t, non_blocking=True)
                else:
                    dst.copy_(t)
                host.append(dst)
            event = torch.cuda.Event()
            event.record(self._stream)
        return host, event, buf

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            epoch, job_id, tensors, (n_topk, has_scale), event, buf, on_done = item
            try:
                if event is not None:
                    event.synchronize()
                try:
                    top = tuple(tensors[5 : 5 + n_topk]) if n_topk else None
                    scale = tensors[-1] if has_scale else None
                    result: ShardInfo | StagedShard | BaseException = self._write(
                        epoch, job_id, *tensors[:5], topk=top, hidden_scale=scale
                    )
                except BaseException as e:  # noqa: BLE001 - handed to on_done and close()
                    result = e
                    self._remember(e)
                del tensors
                if buf is not None:
                    self._pool.give(buf)
                try:
                    on_done(result)
                except BaseException as e:  # noqa: BLE001
                    self._remember(e)
            finally:
                self._slots.release()

    def _remember(self, e: BaseException) -> None:
        if self._error is None:
            self._error = e

    @property
    def error(self) -> BaseException | None:
        """The first error so far (None if none)."""
        return self._error

    def close(self) -> None:
        """Wait for every submitted shard, stop the thread, re-raise the first error."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            try:
                self.close()
            except BaseException:  # noqa: BLE001 - the original exception wins
                pass
