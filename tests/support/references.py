"""The real model's single-process reference, loaded once per test session.

Loading SmolLM2-135M as ``load_quantized_reference`` does (transformers dequantizes every GGUF
tensor, then the linears go back onto the file's 4-bit grid) costs tens of CPU seconds, and
three real-model tests compare against the very same model (tests/test_default_mode.py twice,
tests/test_walkthrough.py). Generation reads the weights and never changes them, so the tests
share one copy. Tiny models are not kept: each is compared once, and they load in milliseconds.
"""
from __future__ import annotations

from pathlib import Path


def quantized_reference(directory, gguf_file: str | None, scheme: str, cache_root: Path | None = None):
    """``load_quantized_reference(directory, gguf_file=, scheme=)``, loaded at its first use in
    the session. ``cache_root`` holds parsed metadata only (the weights are the same without
    it): the first caller's is used."""
    key = (str(Path(directory).resolve()), gguf_file, scheme)
    if key not in _LOADED:
        from fabric.compute.reference import load_quantized_reference

        _LOADED[key] = load_quantized_reference(directory, gguf_file=gguf_file, scheme=scheme, cache_root=cache_root)
    return _LOADED[key]


_LOADED: dict[tuple, object] = {}  # (directory, file, scheme) -> model; one real model in a session
