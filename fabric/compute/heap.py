"""The C library's calls a process makes beside Python's own: handing the heap glibc keeps back
to the OS (:func:`release_freed_memory`), and the file calls Python lacks (:func:`libc_call`)."""
from __future__ import annotations

import ctypes
import functools
import sys


def release_freed_memory() -> None:
    """Hand the heap that loading and quantizing freed back to the OS (glibc keeps it).

    Measured: a full SmolLM2 node's RSS after ``load_shard(quant="int8")`` fell from about
    1070 MiB to 590 MiB with this (the float copies were freed but still resident)."""
    if (trim := libc_call("malloc_trim", ctypes.c_size_t)) is not None:
        trim(0)


@functools.cache
def libc_call(name: str, *argtypes):
    """``name`` from the C library the process runs with (Linux), taking ``argtypes``, or None."""
    if sys.platform != "linux":
        return None
    call = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if call is not None:
        call.argtypes = list(argtypes)
    return call
