import jax
import pytest


def _has_gpu() -> bool:
    return jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
