"""Hashing and writing a fetch's bytes off the loop that receives them.

The fetch is bound by CPU: a hash of every byte (BLAKE3), a write into the page cache, and
the socket's copies, on the fetching machine's cores. The loop that receives chunks and keeps
each peer's window of requests full hands every chunk to one thread of its own
(:class:`Store`), which hashes and writes it (both release the GIL) while the loop goes on
receiving; that thread also judges each finished item against its digest and, for a fetch
that waits for the disk (``meshnet pull``), starts the write-back of a verified one, so that
the finished file's one ``fdatasync`` has little left to wait for (a node's fetch leaves that
to the thread that syncs the file after: it costs CPU the fetch needs). While ``BACKLOG``
bytes wait for those threads, the loop asks for no more chunks.

Where the machine has cores to spare, several such threads (``store_threads``): BLAKE3 runs at
about 3 GB/s on one AVX2 core and the write into the page cache at about as much, so one
thread moves less than a local copy does. A slot's bytes go to the thread with
the fewest bytes waiting when its first chunk comes (the fetch asks for the largest tensors
first: the one hash that must run in order on one thread starts early, and the others share
the rest), and from then on always to that thread, first in first out: the bytes of an item
given up on (its peer left out) are written before those of the item that replaces it, so the
bytes that stand in the file are always those the verdict was taken on. The loop acts on a
verdict only for the item still active under that name: one that comes for an item given up
on is dropped.
"""
from __future__ import annotations

import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field

from ..compute.gguf_manifest import item_hasher
from ..compute.gguf_partial import PartialFile, Slot

STORE_SLICE = 256 << 10  # bytes hashed then written at a time (fits the CPU's L2 cache)
BACKLOG = 32 << 20  # bytes received but not yet written past which the loop asks for no more chunks
MAX_STORE_THREADS = 4  # beyond this the receiving loop, not the hashing, bounds a fetch


def store_threads() -> int:
    """Threads to hash and write with: one a core, at most MAX_STORE_THREADS. The receiving
    loop spends most of its time waiting for answers, and the hash and the write set the pace
    (on 2 cores, with the serving node on the same 2, two threads fetched 1.1x as fast as one
    when the hash was sha256)."""
    return max(1, min(MAX_STORE_THREADS, os.cpu_count() or 1))


@dataclass(eq=False)
class Item:
    """A slot being fetched from one peer; its BLAKE3 digest taken as the bytes arrive in order."""

    slot: Slot
    peer: object  # the fetcher's Peer it is asked of
    next_offset: int = 0  # the next byte to ask for (the loop's)
    received: int = 0  # bytes received and handed to the store (the loop's)
    hasher: object = field(default_factory=item_hasher)  # the store thread's, from here on
    hashed: int = 0  # bytes fed to ``hasher``: all of them, unless a chunk came out of order

    def store(self, part: PartialFile, offset: int, data) -> None:
        """Write ``data`` at ``offset`` of the slot, hashing it on the way where it comes in order:
        a slice at a time, so that the write reads from the CPU's cache what the hash just read."""
        view = memoryview(data)
        in_order = offset == self.hashed
        for at in range(0, len(view), STORE_SLICE):
            piece = view[at:at + STORE_SLICE]
            if in_order:
                self.hasher.update(piece)
            part.write(self.slot, offset + at, piece)
        if in_order:
            self.hashed += len(view)

    def verified(self, part: PartialFile) -> bool:
        """Every byte is in: do they match the manifest's digest? (Read back where some chunk came
        twice, out of order, and so was not hashed as it came.)"""
        if self.hashed == self.slot.nbytes:
            return self.hasher.hexdigest() == self.slot.blake3
        return part.verify(self.slot)


class Store:
    """The threads that hash and write one fetch's chunks, and judge its finished items."""

    def __init__(self, part: PartialFile, threads: int | None = None, write_back: bool = True):
        self.part, self.write_back = part, write_back
        n = threads or store_threads()
        self.jobs = [queue.SimpleQueue() for _ in range(n)]  # (item, offset, data); data None: judge; None: stop
        self.handed = [0] * n  # bytes handed to each thread (the loop's) ...
        self.stored = [0] * n  # ... and written by it (its own)
        self.held_back = False  # the loop asks for no more until the backlog is under BACKLOG (it wakes it)
        self.lanes: dict[str, int] = {}  # slot name -> the thread that takes its bytes
        self.verdicts: deque[tuple[Item, bool | OSError]] = deque()
        self.wake, self._wake_w = os.pipe()  # readable when a verdict waits: the loop polls it beside its sockets
        os.set_blocking(self.wake, False)
        self.threads = [threading.Thread(target=self._work, args=(i,), name=f"fetch-store-{i}", daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def _lane(self, item: Item) -> int:
        """The thread that takes the bytes of ``item``'s slot, in the order handed over: the one with
        the fewest bytes waiting when the slot's first bytes come (a large tensor, hashed in order on
        one thread, leaves the others to the rest)."""
        name = item.slot.name
        if name not in self.lanes:
            self.lanes[name] = min(range(len(self.jobs)), key=lambda i: self.handed[i] - self.stored[i])
        return self.lanes[name]

    def backlog(self) -> int:
        """Bytes handed over and not yet written."""
        return sum(self.handed) - sum(self.stored)

    def full(self) -> bool:
        """Too many bytes wait (the network outpaces the hash and the disk): ask for no more
        chunks until a store thread wakes the loop. Without this bound a fast link would hold
        the whole difference in memory, gigabytes over a large file."""
        self.held_back = True  # first: a thread that writes meanwhile sees it, and wakes the loop
        if self.backlog() < BACKLOG:
            self.held_back = False
        return self.held_back

    def put(self, item: Item, offset: int, data) -> None:
        lane = self._lane(item)
        self.handed[lane] += len(data)
        self.jobs[lane].put((item, offset, data))

    def judge(self, item: Item) -> None:
        """Every chunk of ``item`` was handed over: judge it once they are written."""
        self.jobs[self._lane(item)].put((item, 0, None))

    def _work(self, lane: int) -> None:
        jobs = self.jobs[lane]
        while (job := jobs.get()) is not None:
            item, offset, data = job
            try:
                if data is not None:
                    item.store(self.part, offset, data)
                    self.stored[lane] += len(data)
                    if self.held_back and self.backlog() < BACKLOG:
                        self.held_back = False
                        os.write(self._wake_w, b"\0")
                    continue
                ok = item.verified(self.part)
                if ok and self.write_back:
                    self.part.write_back(item.slot)
                self._tell(item, ok)
            except OSError as exc:  # the disk: full, gone; the loop raises it
                self._tell(item, exc)

    def _tell(self, item: Item, verdict: bool | OSError) -> None:
        self.verdicts.append((item, verdict))
        os.write(self._wake_w, b"\0")

    def judged(self) -> list[tuple[Item, bool | OSError]]:
        """The verdicts taken since the last call, first taken first."""
        try:
            while os.read(self.wake, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while self.verdicts:
            out.append(self.verdicts.popleft())
        return out

    def close(self) -> None:
        """Stop the thread once what was handed to it is written."""
        for jobs, thread in zip(self.jobs, self.threads):
            if thread.is_alive():
                jobs.put(None)
                thread.join()
        for fd in (self.wake, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake = self._wake_w = -1
