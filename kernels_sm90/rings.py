"""What the sm90 kernels share about their ``cutlass.pipeline`` mbarrier rings."""

from __future__ import annotations

import cutlass.pipeline as pipeline


def seq_state(n, stages: int, producer: bool):
    """The pipeline state of the ``n``-th use (from 0) of a ring of ``stages``: computed,
    not carried, so a loop may skip uses (a producer's phase starts flipped)."""
    phase = (n // stages) % 2
    return pipeline.PipelineState(stages, n, n % stages, phase ^ 1 if producer else phase)
