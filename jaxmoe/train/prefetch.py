"""Batches prepared ahead of the step that needs them, on a background thread.

The batches themselves come from the Grain pipeline (:mod:`jaxmoe.data.pipeline`, with its own
worker processes when ``data.workers`` > 0); this thread takes them from it and puts them on
the devices ahead of the step. :class:`Prefetcher` runs the data source and the placement onto
devices (``MeshContext.place_batch`` or a plain transfer) for the next ``depth`` batches while
the current step runs, in order (one producer thread, so batches are exactly the synchronous
loop's). ``position`` is the data source's state after the last batch *handed out*, which is what
a checkpoint must save (the batches queued ahead are not consumed yet). ``depth=0`` runs
everything in the caller's thread. An exception in the producer (a bad data file) is raised by
the next ``next()``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class Prefetcher:
    def __init__(self, source, place: Callable[[dict], Any], depth: int = 2):
        self.source, self.place, self.depth = source, place, int(depth)
        self.position = source.state()
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(self.depth, 1))
        self._thread = None
        if self.depth > 0:
            self._thread = threading.Thread(target=self._produce, name="jaxmoe-prefetch", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.source.next_batch()
                item = ("ok", self.place(batch), self.source.state())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put(("error", e, None))

    def next(self):
        """The next batch (placed), in order."""
        if self._thread is None:
            batch = self.place(self.source.next_batch())
            self.position = self.source.state()
            return batch
        kind, batch, state = self._queue.get()
        if kind == "error":
            raise batch
        self.position = state
        return batch

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    self._thread.join(0.05)
            self._thread = None


__all__ = ["Prefetcher"]
