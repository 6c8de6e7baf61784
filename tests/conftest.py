"""Shared fixtures.

``device`` runs a test on the CPU and, marked ``gpu``, again on CUDA (the torch reference
path on the GPU); the CUDA variant skips when no GPU is present.  ``backend`` runs a GPU
test once per kernel backend shipped (sm80, sm90, ...); variants the GPU cannot run skip.
"""

import pytest
import torch

from bitdecode import backend as backends, dispatch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device(request.param)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: test data is drawn on the CPU, then moved."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.gpu) for name in reversed(backends.shipped())])
def backend(request) -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not dispatch.runnable(request.param, torch.device("cuda")):
        pytest.skip(f"the {request.param} kernels do not run on {torch.cuda.get_device_name()}")
    return request.param
