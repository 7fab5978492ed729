"""A node that hands peers corrupted weights, for tests only: ``meshnet`` whose CHUNK answers
have bits flipped.

    python tests/corrupt_share_node.py [meshnet flags] node --model ... --layers ...

It serves its layers honestly, registers the honest fingerprint and answers MANIFEST with the
honest manifest, but every chunk of a model file it sends has one bit flipped in each 4 KiB,
as a node with a bad disk or a hostile one would. No production flag does this.
"""
from __future__ import annotations

import sys

from fabric.node.share import WeightShare

_honest_read = WeightShare.read


def _corrupt_read(self, offset: int, length: int) -> bytes:
    data = bytearray(_honest_read(self, offset, length))
    for i in range(0, len(data), 4096):
        data[i] ^= 0x01
    return bytes(data)


if __name__ == "__main__":
    WeightShare.read = _corrupt_read
    from fabric.cli import main

    sys.exit(main())
