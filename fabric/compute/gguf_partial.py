"""A partial GGUF file: the source file's metadata section byte for byte, and only the
tensors of one layer range, written as peers send them.

The result is an ordinary GGUF file (gguf-py, transformers and meshnet's loader read it as
they read the source), with three more metadata keys: the source's manifest (so that the
node registers the source's fingerprint and can serve what it holds), the layers it holds,
and the model id the swarm lists. Its layout is fixed before a byte arrives, from the
manifest and the range alone: the file is built as ``NAME.part`` at its final size, each
tensor written into its slot, and a journal (``NAME.part.done``) names every item whose
bytes were verified. A restarted fetch that finds the same layout hashes the journal's
items again (local reads: fast), keeps those that still verify, and fetches the rest. The
file is renamed to NAME once every item verified.

A node serves from the page cache, as ``cp`` leaves a file: it need not wait for the disk. So
a node's fetch renames the file at once and a thread writes it to disk (``fdatasync``) while
the node loads and serves; until that ends, the journal stands beside the file as
``NAME.unsynced``. A copy found with that marker (the process ended before its bytes reached
the disk: a crash may have lost some) is not trusted as it stands: the next fetch takes it
back as a ``.part`` and hashes its items again. ``meshnet pull`` waits for the disk.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from ..wire.shard import Shard
from .gguf_info import read_header
from .gguf_manifest import (
    KV_NAME,
    KV_START,
    LAYERS_KEY,
    MANIFEST_KEY,
    MODEL_KEY,
    FileManifest,
    OutdatedManifest,
    hash_range,
)
from .heap import libc_call
from .model_ref import ModelError

log = logging.getLogger(__name__)

_STRING = 8  # GGUF value type of a string
PEERS_DIR = "peers"  # under the models directory: the partial copies fetched from peers


@dataclass(frozen=True)
class Slot:
    """Where one item (the metadata section, or a tensor) goes in the partial file."""

    name: str  # a tensor's name, or KV_NAME
    offset: int  # absolute, in the partial file
    nbytes: int
    blake3: str  # the manifest's digest of its bytes


@dataclass(frozen=True)
class Layout:
    header: bytes  # the file's first bytes up to the data, the metadata section's slot zeroed
    slots: tuple[Slot, ...]
    size: int  # the whole file's bytes


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv_string(key: str, value: str) -> bytes:
    return _string(key) + struct.pack("<I", _STRING) + _string(value)


def layout(manifest: FileManifest, shard: Shard, model_id: str) -> Layout:
    """The partial file of ``manifest``'s tensors that ``shard`` needs, laid out."""
    tensors = manifest.needed(shard)
    align = manifest.alignment
    extra = (_kv_string(MANIFEST_KEY, manifest.canonical().decode()) + _kv_string(LAYERS_KEY, f"{shard.start}-{shard.end}")
             + _kv_string(MODEL_KEY, model_id))
    offsets, at = [], 0
    for t in tensors:
        at = -(-at // align) * align
        offsets.append(at)
        at += t.nbytes
    infos = b"".join(_string(t.name) + struct.pack("<I", len(t.shape)) + struct.pack(f"<{len(t.shape)}Q", *t.shape)
                     + struct.pack("<IQ", t.type_id, off) for t, off in zip(tensors, offsets))
    head = b"GGUF" + struct.pack("<IQQ", manifest.version, len(tensors), manifest.kv_count + 3)
    header = head + bytes(manifest.kv_bytes) + extra + infos
    data_start = -(-len(header) // align) * align
    header += bytes(data_start - len(header))
    slots = [Slot(KV_NAME, KV_START, manifest.kv_bytes, manifest.kv_blake3)]
    slots += [Slot(t.name, data_start + off, t.nbytes, t.blake3) for t, off in zip(tensors, offsets)]
    return Layout(header, tuple(slots), data_start + at)


class PartialFile:
    """The ``.part`` file being fetched: its slots, which of them verified, and writes into them."""

    def __init__(self, target: Path, plan: Layout):
        self.target, self.plan = target, plan
        self.part = target.with_name(target.name + ".part")
        self.journal = target.with_name(target.name + ".part.done")
        self.unsynced = unsynced_marker(target)
        self.syncing: threading.Thread | None = None  # the write to disk after a finish that did not wait for it
        self.done: set[str] = set()
        self.fd = -1
        self._journal = None  # the journal, open for appending once an item verified

    def open(self) -> int:
        """Open (resuming where a layout matches) and return the bytes already verified."""
        if self.unsynced.exists() and self.target.exists():  # finished, but maybe not all on disk: resume it
            self.target.replace(self.part)
            self.unsynced.replace(self.journal)
        resumable = self.part.is_file() and self.part.stat().st_size == self.plan.size and self._header_matches()
        if not resumable:
            self.journal.unlink(missing_ok=True)
            with open(self.part, "wb") as f:
                f.truncate(self.plan.size)
                f.write(self.plan.header)
        self.fd = os.open(self.part, os.O_RDWR)
        try:
            _reserve(self.fd, self.plan.size)
        except OSError:
            self.close()
            if not resumable:
                self.part.unlink(missing_ok=True)  # give back what it took
            raise
        if resumable:
            self.done = {s.name for s in self.plan.slots if s.name in self._journaled() and self.verify(s)}
            self._rewrite_journal()
        return sum(s.nbytes for s in self.plan.slots if s.name in self.done)

    def _header_matches(self) -> bool:
        """The ``.part`` was laid out as this fetch lays it out (its metadata slot left aside)."""
        with open(self.part, "rb") as f:
            have = f.read(len(self.plan.header))
        kv = self.plan.slots[0]
        cut = slice(kv.offset, kv.offset + kv.nbytes)
        return len(have) == len(self.plan.header) and \
            have[:cut.start] + have[cut.stop:] == self.plan.header[:cut.start] + self.plan.header[cut.stop:]

    def _journaled(self) -> set[str]:
        try:
            return {line for line in self.journal.read_text().splitlines() if line}
        except OSError:
            return set()

    def _rewrite_journal(self) -> None:
        self.journal.write_text("".join(f"{n}\n" for n in sorted(self.done)))

    def missing(self) -> list[Slot]:
        return [s for s in self.plan.slots if s.name not in self.done]

    def write(self, slot: Slot, offset: int, data) -> None:
        """``data`` into ``slot`` at ``offset`` bytes from its start (the caller checked the bounds)."""
        view = memoryview(data)
        at = 0
        while at < len(view):
            at += os.pwrite(self.fd, view[at:], slot.offset + offset + at)

    def write_back(self, slot: Slot) -> None:
        """Start writing ``slot``'s bytes to disk now, without waiting (``sync_file_range``, where
        the C library has it): the ``fdatasync`` that a durable ``finish`` takes then waits for less."""
        call = libc_call("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        if call is not None:
            call(self.fd, slot.offset, slot.nbytes, _SYNC_FILE_RANGE_WRITE)

    def verify(self, slot: Slot) -> bool:
        return hash_range(self.fd, slot.offset, slot.nbytes) == slot.blake3

    def mark_done(self, slot: Slot) -> None:
        """``slot`` verified: journal it (``flush_journal`` hands the lines to the OS). No fsync: a
        resumed fetch hashes every journaled item again, so one whose bytes a crash lost is fetched
        again, not trusted."""
        self.done.add(slot.name)
        if self._journal is None:
            self._journal = open(self.journal, "a")
        self._journal.write(slot.name + "\n")

    def flush_journal(self) -> None:
        """The items marked done so far, out of this process's buffer: a kill loses none of them."""
        if self._journal is not None:
            self._journal.flush()

    def finish(self, durable: bool = True) -> Path:
        """Every slot verified: the ``.part`` becomes the file. ``durable``: its bytes on disk first
        (a finished copy is trusted at the next start without hashing; fdatasync: the size was set
        when the ``.part`` was made); else renamed now, with its journal as the ``.unsynced``
        marker until a thread has them on disk (``wait_synced``)."""
        if durable:
            os.fdatasync(self.fd)
            self.close()
            self.part.replace(self.target)
            self.journal.unlink(missing_ok=True)
            self.unsynced.unlink(missing_ok=True)  # one left by a copy since deleted would hide this one
            return self.target
        self._close_journal()
        self.journal.touch()
        self.journal.replace(self.unsynced)  # first: a crash that keeps the rename below keeps the marker too
        self.part.replace(self.target)
        fd, self.fd = self.fd, -1
        self.syncing = threading.Thread(target=_sync_then_unmark, args=(fd, self.target), daemon=True,
                                        name="partial-sync")
        self.syncing.start()
        return self.target

    def wait_synced(self) -> None:
        """Until a finish that did not wait has the file's bytes on disk."""
        if self.syncing is not None:
            self.syncing.join()

    def close(self) -> None:
        self._close_journal()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None


def unsynced_marker(path: Path) -> Path:
    """Beside a finished partial copy while its bytes may not all be on disk yet."""
    return path.with_name(path.name + ".unsynced")


def _sync_then_unmark(fd: int, target: Path) -> None:
    try:
        os.fdatasync(fd)
        unsynced_marker(target).unlink(missing_ok=True)
    except OSError as exc:  # the disk failed: the marker stays, and the next start hashes the copy again
        log.warning("could not write %s to disk: %s", target.name, exc)
    finally:
        os.close(fd)


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks now (``fallocate(2)``, where the file system has it): a disk
    too small fails here with ENOSPC, not hours into the fetch. On ext4 a fetch takes as long
    as into a sparse file: the writes take less CPU, the final ``fdatasync`` marks the blocks
    written."""
    call = fallocate()
    if call is None or call(fd, 0, 0, size) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS):  # not supported: the writes allocate as they go
        raise OSError(err, os.strerror(err))


def fallocate():
    """``fallocate(fd, mode, offset, length)`` from the C library (Linux), or None."""
    return libc_call("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages back; wait for none


def partial_name(model_id: str, digest: str, shard: Shard) -> str:
    """``MODEL.DIGEST8.layers-A-B.gguf``: the model id made safe for a file name."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    return f"{safe}.{digest[:8]}.layers-{shard.start}-{shard.end}.gguf"


def find_partial(directory: Path, model_id: str, start: int, end: int) -> Path | None:
    """A finished partial copy of ``model_id`` in ``directory`` that holds layers ``start..end``
    (not one whose bytes may not be on disk, nor one an older meshnet made: both are fetched again)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob(f"{safe}.*.layers-*.gguf")):
        a, _, b = path.name.removesuffix(".gguf").rpartition(".layers-")[2].partition("-")
        try:
            first, last = int(a), int(b)
        except ValueError:
            continue
        if first <= start and end <= last and not unsynced_marker(path).exists():
            entry = describe_partial(path)
            if entry is not None and not entry["outdated"]:
                return path
    return None


def describe_partial(path: Path) -> dict | None:
    """What ``meshnet models`` lists of a partial copy: its model, layers and bytes (None: unreadable)."""
    manifest = None
    try:
        meta = read_header(path).metadata
        first, last = (int(x) for x in str(meta[LAYERS_KEY]).split("-"))
        manifest = FileManifest.from_json(json.loads(meta[MANIFEST_KEY]))
    except OutdatedManifest:  # listed, so that its owner can delete it; never loaded
        pass
    except (KeyError, ValueError, OSError, ModelError):
        return None
    total = manifest.num_layers if manifest else None
    return {"name": meta.get(MODEL_KEY) or path.name, "path": str(path), "bytes": path.stat().st_size,
            "num_layers": total, "layers": [[first, last]], "complete": (first, last) == (0, (total or 0) - 1),
            "manifest": manifest and manifest.digest, "synced": not unsynced_marker(path).exists(),
            "outdated": manifest is None}
