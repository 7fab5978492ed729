"""A node's configuration, grouped as the node is: what it holds and computes, how it
schedules hops, how it heads requests, and its links to the tracker and a relay."""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..compute.models import ModelSource
from ..net.node_id import stable_node_id  # noqa: F401 -- re-exported: fabric.node's id
from ..net.security import Security
from ..wire.shard import Shard
from .audit import AuditConfig
from .head import HeadConfig
from .links import LinkConfig
from .scheduler import SchedulerConfig


@dataclass(frozen=True)
class NodeConfig:
    source: ModelSource  # what to load
    shard: Shard  # which layers this node holds
    bind: str = "tcp://127.0.0.1:0"  # ROUTER address; port 0 picks a free port
    advertise: str | None = None  # endpoint peers should dial; defaults to the bound one
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    quant: str | None = None  # "int8" / "int4": weight-only quantized shard (bfloat16 compute, CPU)
    # a head's draft model (``--draft``): loaded whole on the same device, it drafts beside prompt lookup; it
    # must share the served model's tokenizer. None: prompt lookup alone
    draft: ModelSource | None = None
    draft_quant: str | None = None  # its weight-only kernels, as ``quant`` (``--draft-quant`` picked for its file)
    draft_dtype: torch.dtype | None = None  # its compute dtype (bfloat16 under draft_quant); None: ``dtype``
    node_id: str = field(default_factory=lambda: "node-" + secrets.token_hex(4))
    kv_idle_timeout: float = 300.0  # free a session's KV after this long unused
    max_sessions: int = 64  # concurrent sessions this node keeps KV for
    drain_timeout: float = 30.0  # a leaving node (SIGTERM) exits once its sessions end, or after this many seconds
    kv_cache_bytes: int | None = None  # ended sessions' KV kept for reuse; None: a share of free memory (kv.py)
    compute_lock: str | None = None  # a file nodes sharing this machine lock while they compute (one at a time);
    # None: no lock (`meshnet node` gives its device's default file, see compute_lock.default_path)
    # one-token passes on one thread where that is no slower, measured at load (HopRunner.tune_step_threads):
    # `meshnet node` without --threads
    tune_threads: bool = False
    # decode passes (decode steps alone) on this many threads outside the compute lock, so that nodes of one
    # machine decode at once, each on its share of the cores, and streams run as a pipeline of groups; 0: every
    # pass under the lock (HopRunner.ready); None (`meshnet node`'s default): this machine's share of the cores
    # where the node decodes at once by default (hops.decodes_at_once), else 0
    decode_threads: int | None = 0
    max_frame_bytes: int = 64 << 20  # largest tensor buffer accepted from a peer
    cache_root: Path | None = None  # where parsed GGUF metadata is cached
    share_bytes_per_s: float = 0.0  # bytes/s of its model file handed to peers fetching layers; 0: no cap
    progress: bool = True  # show a progress bar while weights load
    security: Security | None = None  # CurveZMQ keys and allow-list; None: plaintext (a trusted LAN)
    scheduler: SchedulerConfig = SchedulerConfig()  # batching and prefill slices
    head: HeadConfig = HeadConfig()  # requests this node heads: timeouts, pings, prompt limit
    link: LinkConfig = LinkConfig()  # the tracker and relay
    audit: AuditConfig = AuditConfig()  # how often requests this node heads are checked on replicas

    @classmethod
    def build(cls, source: ModelSource, shard: Shard, **options) -> "NodeConfig":
        """A config from flat options (``max_batch=8, tracker=None``): each goes to the group
        that has a field of its name. An unknown name raises TypeError."""
        groups = {"scheduler": SchedulerConfig, "head": HeadConfig, "link": LinkConfig, "audit": AuditConfig}
        parts: dict[str, dict] = {name: {} for name in groups}
        top = {}
        for name, value in options.items():
            group = next((g for g, kind in groups.items() if name in _fields(kind)), None)
            if group is None and name not in _fields(cls):
                raise TypeError(f"NodeConfig has no option {name!r}")
            (parts[group] if group else top)[name] = value
        return cls(source, shard, **top, **{g: groups[g](**kw) for g, kw in parts.items()})


def _fields(kind: type) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)}
