"""torch tensors <-> (TensorSpec, raw buffer), zero copy in both directions.

Sending: a contiguous CPU tensor is exposed as a buffer over its own storage (numpy view,
no copy) and handed to ``send_multipart(copy=False)``. Receiving: ``torch.frombuffer`` over
the received frame's memory; the spec was validated by ``protocol.decode`` so the byte
count already matches the shape.
"""
from __future__ import annotations

import warnings

import torch

from ..wire.protocol import DTYPE_SIZES, ProtocolError, TensorSpec

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,  # raw bytes (a model file's chunks): no FORWARD or AUDIT accepts it
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel on the wire") from None


def to_wire(tensor: torch.Tensor) -> tuple[TensorSpec, memoryview]:
    """(spec, buffer) for ``tensor``; the buffer shares the tensor's memory."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    spec = TensorSpec(dtype_name(t.dtype), tuple(t.shape))
    # view the storage as bytes: works for bfloat16, which numpy cannot represent
    raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return spec, memoryview(raw.numpy())


def from_wire(spec: TensorSpec, buffer: memoryview) -> torch.Tensor:
    """A tensor over ``buffer`` (no copy). Read-only frames are fine: compute never writes inputs."""
    if spec.dtype not in TORCH_DTYPES:
        raise ProtocolError(f"dtype {spec.dtype!r} is not allowed")
    if buffer.nbytes != spec.nbytes:
        raise ProtocolError(f"buffer has {buffer.nbytes} bytes, spec needs {spec.nbytes}")
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
    with warnings.catch_warnings():
        # zmq frames are read-only; torch warns that writing would be undefined. We never write.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=TORCH_DTYPES[spec.dtype])
    return flat.view(spec.shape)


assert set(TORCH_DTYPES) == set(DTYPE_SIZES)  # module invariant, not peer input
