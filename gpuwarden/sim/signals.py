"""Deterministic signals: a list of pieces evaluated at any scenario time, noise included.

The noise is drawn from a hash of (seed, signal, whole second), so the same file and ``t``
always give the same value, in any order and in any process.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from gpuwarden.sim.spec import PieceSpec


def gauss(seed: int, key: str, bucket: int) -> float:
    """A standard normal draw that depends only on its arguments (not on call order or process)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{bucket}".encode(), digest_size=16).digest()
    a, b = struct.unpack("<QQ", digest)
    u1 = (a + 1) / 2.0**64  # in (0, 1]: log() is safe
    u2 = b / 2.0**64
    draw = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return max(-3.0, min(3.0, draw))  # three sigma: noise, not outliers


@dataclass(frozen=True, slots=True)
class Signal:
    """A list of pieces resolved into (start time, piece, value carried in) and evaluated at ``t``."""

    seed: int
    key: str
    ats: tuple[float, ...]
    pieces: tuple[PieceSpec, ...]
    carried: tuple[float, ...]
    low: float
    high: float

    @classmethod
    def build(cls, seed: int, key: str, pieces: list[Any], low: float, high: float) -> Signal:
        # What each piece continues from when it has no `start`: where the one before ended.
        carried = [0.0]
        for before, piece in itertools.pairwise(pieces):
            carried.append(before.base(piece.at - before.at, carried[-1]))
        return cls(seed, key, tuple(p.at for p in pieces), tuple(pieces), tuple(carried), low, high)

    def __call__(self, t: float) -> float:
        i = max(0, bisect_right(self.ats, t) - 1)
        piece = self.pieces[i]
        value = piece.base(t - piece.at, self.carried[i])
        if piece.noise:
            value += piece.noise * gauss(self.seed, self.key, math.floor(t))
        return min(self.high, max(self.low, value))
