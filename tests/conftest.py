"""Shared fixtures.

``device`` runs a test on the CPU and, marked ``gpu``, again on CUDA (the torch reference
path on the GPU); the CUDA variant skips when no GPU is present.
"""

import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device(request.param)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: test data is drawn on the CPU, then moved."""
    return torch.Generator().manual_seed(1234)
