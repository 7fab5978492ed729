"""Flags several commands share, and what they resolve to (the key pair, the metrics server)."""
from __future__ import annotations

import argparse

from ..flags import endpoint, port
from ..wire.liveness import DEFAULT_TRACKER


def tracker_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracker", default=DEFAULT_TRACKER, type=endpoint, metavar="ENDPOINT",
                   help="tracker endpoint, tcp://HOST:PORT or HOST:PORT (default %(default)s)")
    keys_flag(p)


def keys_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="secure the swarm with CurveZMQ: this process's key pair and the allow-list "
                        "(made by `meshnet keys DIR`); default: plaintext, for a trusted LAN")


def quant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", default="auto", choices=["auto", "none", "int8", "int4", "gguf"],
                   help="weight-only quantized layers, computed in bfloat16 on the CPU. auto (default): a GGUF on "
                        "its own grid (gguf: Q4_0/Q4_1/Q4_K layers on the file's codes and Q6_K/Q8_0 "
                        "re-rounded onto int8, on an int8-activation kernel as llama.cpp computes; Q5_* on the "
                        "file's own blocks; float16 in bfloat16; a float32 file, other weights, "
                        "a GPU: none); none: every layer in --dtype (with --dtype float32: exact, the tokens "
                        "of transformers in float32); int8, int4: every linear onto that kernel")


def metrics_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=port, default=0,
                   help="serve Prometheus /metrics on this port, 0 for none (default %(default)s)")


def serve_metrics(args, sample) -> None:
    if args.metrics_port:
        from ..metrics import serve

        serve(args.metrics_port, sample)


TRACKER_ID_KEY = "the tracker's id.key"


def load_security(args, tracker_key_file: str | None = TRACKER_ID_KEY):
    """The Security for ``--keys`` (None without it); SecurityError says what is missing. A
    process that dials the tracker needs DIR/allowed/tracker.key (``tracker_key_file``: the
    file to copy there; None for the tracker and the relay, which do not dial it)."""
    from ..net.security import load, require_tracker_key

    security = load(args.keys) if getattr(args, "keys", None) else None
    if tracker_key_file:
        require_tracker_key(security, tracker_key_file)
    return security




def _device(text: str) -> str:
    """cpu, cuda, or cuda:N (one GPU of several)."""
    kind, _, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not index or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")


def device_flags(p: argparse.ArgumentParser, whose: str, more: str = "") -> None:
    p.add_argument("--device", default="cpu", type=_device, metavar="{cpu,cuda,cuda:N}",
                   help=f"where {whose} layers compute (default %(default)s; cuda needs a CUDA build of torch, "
                        f"cuda:N picks one GPU of several{more})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help=f"{whose} compute dtype for layers that --quant leaves as they are (default %(default)s, "
                        "exact; bfloat16 halves the memory, and suits --device cuda); quantized layers compute "
                        "in bfloat16")
