import jax
import pytest


def _has_gpu() -> bool:
    return jax.default_backend() == "gpu"


# Seconds each file took on CI's two cores (`--durations=0`, session 26): `make test` hands
# whole files to two processes in this order (`--no-loadscope-reorder`), longest first, so that
# no long file starts last while the other process runs out of work. Unlisted files go last.
CI_SECONDS = {
    "test_attention.py": 324,
    "test_engine.py": 245,
    "test_model.py": 166,
    "test_tensor_parallel.py": 147,
    "test_benchmarks.py": 135,
    "test_shared_prefix.py": 103,
    "test_checkpoint.py": 99,
    "test_triton_prefill.py": 80,
    "test_mosaic_decode.py": 62,
    "test_layers.py": 61,
    "test_triton_decode.py": 58,
    "test_layer_kernels.py": 40,
    "test_merge.py": 37,
    "test_page_pool.py": 33,
    "test_readme.py": 29,
    "test_sampling.py": 23,
    "test_mosaic_prefill.py": 19,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -CI_SECONDS.get(item.path.name, 0))  # stable within a file
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
