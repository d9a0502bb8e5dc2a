"""The Triton split-KV decode kernel: its split rule and configs, its lowering for CUDA (run on
this GPU-less machine) and the edge cases of lengths, splits, shapes and metadata against the
float64 oracle. Features (window, soft cap, scale) for every backend are in test_attention.py.

Without a GPU the kernel runs in Pallas interpret mode on a small subset; the `gpu` marker runs
the full matrix compiled on the H200.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from pallas_kernels.common import H200_NUM_SMS, poison_outputs
from pallas_kernels.triton import paged_decode
from pallas_kernels.triton.paged_decode import DecodeConfig, choose_num_splits
from tests.helpers import assert_close, lower_for_cuda, make_batch, oracle

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
GQA = ((4, 4), (8, 2), (8, 1))  # (Hq, Hkv): groups of 1, 4 and 8 query heads
FEATURES = (dict(), dict(sliding_window=37, logits_soft_cap=5.0))
_ORACLE_OPTIONS = ("sm_scale", "sliding_window", "logits_soft_cap")


def _edge_lens(page_size: int, long: int) -> list[int]:
    return [0, 1, page_size - 1, page_size, page_size + 1, long]


def _check(batch, dtype, **kw):
    """The kernel against the float64 oracle, with NaN-poisoned output buffers."""
    with poison_outputs():
        out, lse = jaxpaged.paged_decode_attention(
            batch.q,
            batch.k_pages,
            batch.v_pages,
            batch.kv_lens,
            batch.page_indices,
            return_lse=True,
            implementation="triton",
            **kw,
        )
    options = {k: v for k, v in kw.items() if k in _ORACLE_OPTIONS}
    assert_close(out, lse, *oracle(batch, **options), dtype)


def _decode_batch(
    rng, lens, *, num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32
):
    return make_batch(
        rng,
        [(1, n) for n in lens],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        pad_tokens=0,
        pad_seqs=0,
    )


# --- the split rule and the configs ---------------------------------------------------------


def test_num_splits_large_batch_gets_few_long_sequence_many():
    assert choose_num_splits(64, 8, 4096, block_kv=64) == 3
    assert choose_num_splits(512, 8, 4096, block_kv=64) == 1
    assert choose_num_splits(1, 8, 32768, block_kv=64) == 64
    assert choose_num_splits(8, 8, 32768, block_kv=64) == 17


@pytest.mark.parametrize("num_seqs", [1, 3, 16, 64, 1000])
@pytest.mark.parametrize("max_kv_len", [0, 1, 255, 4096, 131072])
@pytest.mark.parametrize("block_kv", [32, 64])
def test_num_splits_rule(num_seqs, max_kv_len, block_kv):
    """The fewest splits that fill 8 programs per SM, unless a split would get < 8 tiles."""
    n = choose_num_splits(num_seqs, 8, max_kv_len, block_kv=block_kv)
    assert n >= 1
    assert n == 1 or max_kv_len // n >= 8 * block_kv
    target = 8 * H200_NUM_SMS
    assert num_seqs * 8 * n >= target or n == max(max_kv_len // (8 * block_kv), 1)
    assert n == 1 or num_seqs * 8 * (n - 1) < target
    assert choose_num_splits(num_seqs, 8, max_kv_len, block_kv=block_kv, num_sms=2 * 132) >= n


def test_default_configs():
    assert DecodeConfig.default(128, jnp.bfloat16) == DecodeConfig(block_kv=64)
    assert DecodeConfig.default(64, jnp.float16).block_kv == 128
    assert DecodeConfig.default(256, jnp.float32).block_kv == 16
    with pytest.raises(ValueError, match="D=96"):
        DecodeConfig.default(96, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_kv"):
        DecodeConfig(block_kv=48)
    with pytest.raises(ValueError, match="num_warps"):
        DecodeConfig(num_warps=3)


def test_unsupported_head_dim_is_a_clear_error():
    rng = np.random.default_rng(0)
    batch = _decode_batch(rng, [5, 9], head_dim=96)
    with pytest.raises(ValueError, match="head dim D=96"):
        jaxpaged.paged_decode_attention(
            batch.q,
            batch.k_pages,
            batch.v_pages,
            batch.kv_lens,
            batch.page_indices,
            implementation="triton",
        )


# --- lowering for CUDA (Pallas -> Triton IR, no GPU needed) ---------------------------------


@pytest.fixture
def triton_modules(monkeypatch):
    """The text of every Triton module lowered while the test runs."""
    from jax._src.pallas.triton import lowering

    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", capture)
    return modules


def _lower(
    triton_modules, *, head_dim, num_q_heads, num_kv_heads, dtype, page_size, num_pages=64, **kw
):
    q = jax.ShapeDtypeStruct((3, num_q_heads, head_dim), dtype)
    pages = jax.ShapeDtypeStruct((num_pages, page_size, num_kv_heads, head_dim), dtype)
    kv_lens = jax.ShapeDtypeStruct((3,), jnp.int32)
    table = jax.ShapeDtypeStruct((3, 9), jnp.int32)
    triton_modules.clear()
    lower_for_cuda(
        lambda *a: paged_decode.paged_decode_attention(*a, **kw), q, pages, pages, kv_lens, table
    )
    # With several splits a second module merges them (pallas_kernels/triton/merge.py).
    [module] = [m for m in triton_modules if "merge_split_kv" not in m]
    return module


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lowers_for_cuda(triton_modules, head_dim, heads, dtype, page_size, features):
    module = _lower(
        triton_modules,
        head_dim=head_dim,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        dtype=dtype,
        page_size=page_size,
        **features,
    )
    # Float32 dots must be IEEE (Triton prints no inputPrecision for IEEE).
    assert "inputPrecision" not in module
    # Interior tiles: the loop's loads (page ids, K, V) carry no mask.
    start = module.index("scf.for")
    body = module[start : module.index("scf.yield", start)]
    loads = re.findall(r"tt\.load ([^:]*):", body)
    assert len(loads) == 3 and all("," not in operands for operands in loads), loads


def test_lowers_for_cuda_one_split_and_a_pool_over_4gib(triton_modules):
    """One split writes the final output itself; a pool over 4 GiB needs 64-bit offsets."""
    module = _lower(
        triton_modules,
        head_dim=128,
        num_q_heads=32,
        num_kv_heads=8,
        dtype=jnp.bfloat16,
        page_size=16,
        num_pages=2**17 + 1,
        num_splits=1,
    )
    assert "tensor<64x128xi64>" in module
    assert re.search(r"%arg5: !tt\.ptr<bf16>", module)  # the output, in q's dtype


# --- correctness in interpret mode (CPU subset) and compiled (gpu) --------------------------


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_edge_lengths_and_a_long_context(page_size, dtype):
    rng = np.random.default_rng(page_size)
    batch = _decode_batch(rng, _edge_lens(page_size, 3000), page_size=page_size, dtype=dtype)
    _check(batch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_edge_lengths_and_a_32k_context(page_size, dtype):
    rng = np.random.default_rng(page_size)
    batch = _decode_batch(
        rng,
        _edge_lens(page_size, 32768),
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=page_size,
        dtype=dtype,
    )
    _check(batch, dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_num_splits_override(num_splits, features):
    """One split, a few, and more splits than pages (most of them empty: identity in the merge)."""
    rng = np.random.default_rng(num_splits)
    _check(_decode_batch(rng, [0, 1, 40, 17, 230]), jnp.float32, num_splits=num_splits, **features)


def test_ragged_batch():
    rng = np.random.default_rng(11)
    lens = list(rng.integers(0, 700, size=12))
    _check(
        _decode_batch(rng, lens, num_q_heads=8, num_kv_heads=2, dtype=jnp.bfloat16),
        jnp.bfloat16,
        sliding_window=300,
    )


def _shape(head_dim, heads, dtype, *marks):
    name = f"d{head_dim}-hq{heads[0]}-hkv{heads[1]}-{jnp.dtype(dtype).name}"
    return pytest.param(head_dim, heads, dtype, marks=marks, id=name)


_SHAPES_CPU = [(64, (4, 4), jnp.float32), (128, (8, 2), jnp.bfloat16), (256, (8, 1), jnp.float16)]
SHAPES = [_shape(*case) for case in _SHAPES_CPU] + [
    _shape(*case, pytest.mark.gpu)
    for case in itertools.product([64, 128, 256], GQA, DTYPES)
    if case not in _SHAPES_CPU
]


@pytest.mark.parametrize("head_dim, heads, dtype", SHAPES)
def test_shapes(head_dim, heads, dtype):
    rng = np.random.default_rng(head_dim + heads[1])
    for page_size, features in zip([16, 64], FEATURES, strict=True):
        batch = _decode_batch(
            rng,
            _edge_lens(page_size, 333),
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
        )
        _check(batch, dtype, **features)


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(block_kv=16, num_stages=2),
        DecodeConfig(block_kv=128, num_warps=8, num_stages=2),
    ],
    ids=["small-tiles", "big-tiles"],
)
def test_configs(config):
    rng = np.random.default_rng(config.block_kv)
    _check(
        _decode_batch(rng, [1, 15, 16, 17, 129, 300]),
        jnp.float32,
        config=config,
        sliding_window=100,
    )


def test_page_size_not_a_power_of_two():
    """Tiles are gathered key by key, so pages of any size work, even smaller than a tile."""
    rng = np.random.default_rng(12)
    batch = _decode_batch(rng, [0, 1, 11, 12, 13, 100], page_size=12)
    _check(batch, jnp.float32, config=DecodeConfig(block_kv=16), num_splits=2)


def test_garbage_metadata_stays_in_bounds():
    """Slots with negative or huge kv_len and page ids outside the pool: no out-of-bounds
    access (a crash on the GPU), a clamped inactive slot, and the valid slots unaffected."""
    rng = np.random.default_rng(3)
    batch = _decode_batch(rng, [5, 40, 17, 0])
    bad_lens = jnp.asarray([5, -7, 17, 10**6], jnp.int32)
    bad_table = batch.page_indices.at[1:].set(
        jnp.asarray(rng.integers(-(2**30), 2**30, size=batch.page_indices[1:].shape), jnp.int32)
    )
    bad_table = bad_table.at[2].set(batch.page_indices[2])
    out, lse = jaxpaged.paged_decode_attention(
        batch.q,
        batch.k_pages,
        batch.v_pages,
        bad_lens,
        bad_table,
        return_lse=True,
        implementation="triton",
    )
    ref_out, ref_lse = oracle(batch)
    keep = np.array([0, 2])
    assert_close(out[keep], lse[keep], ref_out[keep], ref_lse[keep], jnp.float32)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    assert np.isneginf(np.asarray(lse[1])).all()
