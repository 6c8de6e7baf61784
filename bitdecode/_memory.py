"""Giving device memory back between benchmark cases without biasing the next timing.

Freed device memory slows the memory-bound kernels that follow for a while (H100, the
sixty-fifth session, profiles/NOTES.md): a 4-bit decode at B=1 N=128K ran 56.5 us before
and ~65 us (+15 %) for ~11 ms after 4 GB went back to the driver, for over 24 ms after 12
GB, and unchanged after 0.4 GB; clocks, power and throttle reasons stayed the same (the
driver's own work on the freed pages, its scrubbing the likeliest).  So every benchmark
waits ``SETTLE_S_PER_GB`` a GB freed (about 4x the transient measured) before it times
again."""

from __future__ import annotations

import time

import torch

SETTLE_S_PER_GB = 0.01


def release_memory() -> float:
    """``torch.cuda.empty_cache()``, then wait out the slow spell that the freed memory
    brings (``SETTLE_S_PER_GB``); the seconds waited."""
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    wait = (before - torch.cuda.memory_reserved()) / 2 ** 30 * SETTLE_S_PER_GB
    time.sleep(wait)
    return wait
