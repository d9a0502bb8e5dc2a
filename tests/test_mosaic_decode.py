"""The Mosaic GPU paged decode kernel (pallas_kernels/mosaic/paged_decode.py).

Without a GPU: the Pallas -> Mosaic GPU lowering runs here for every supported shape (cross-
lowering for CUDA, which includes Mosaic GPU's layout inference and dialect lowering, but not
ptxas or a launch; no Triton kernel could lower here), plus the checks that run before
tracing. With a GPU (`-m gpu`): results against the float64 loop of tests/helpers over the
decode feature matrix. The shared decode body in tests/test_attention.py runs this kernel too
(backend "mosaic-gpu").
"""

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import jaxpaged
from pallas_kernels.common import poison_outputs
from pallas_kernels.mosaic import paged_decode as mosaic
from pallas_kernels.mosaic import rope_append as rope_append_kernel
from pallas_kernels.mosaic import slot_order
from tests.helpers import assert_close, latin_square, lower_for_hopper, make_batch, oracle

DTYPES = (jnp.bfloat16, jnp.float16)
HEADS = [(4, 4), (16, 4), (16, 2)]  # (Hq, Hkv): GQA groups 1, 4, 8
SHAPES = list(itertools.product([64, 128, 256], HEADS, [16, 64]))


def _shape_id(shape):
    head_dim, (num_q_heads, num_kv_heads), page_size = shape
    return f"d{head_dim}-hq{num_q_heads}-hkv{num_kv_heads}-ps{page_size}"


def _abstract_args(head_dim, num_q_heads, num_kv_heads, page_size, dtype, *, seqs=3, pages=40):
    pages_per_seq = 9
    kv = jax.ShapeDtypeStruct((pages, page_size, num_kv_heads, head_dim), dtype)
    return (
        jax.ShapeDtypeStruct((seqs, num_q_heads, head_dim), dtype),
        kv,
        kv,
        jax.ShapeDtypeStruct((seqs,), jnp.int32),
        jax.ShapeDtypeStruct((seqs, pages_per_seq), jnp.int32),
    )


def _mosaic_fn(**options):
    options.setdefault("sm_scale", 0.125)
    return lambda *args: mosaic.paged_decode_attention(*args, **options)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize(
    "shape", latin_square([64, 128, 256], HEADS, [16, 64]), ids=_shape_id
)  # every pair of values: the GPU tests run every shape
def test_cross_lowers(shape, dtype):
    head_dim, (num_q_heads, num_kv_heads), page_size = shape
    args = _abstract_args(head_dim, num_q_heads, num_kv_heads, page_size, dtype)
    text = lower_for_hopper(_mosaic_fn(), *args)
    assert "mosaic_gpu" in text


LOWERING_FEATURES = [
    dict(sliding_window=5),
    dict(logits_soft_cap=2.5),
    dict(num_splits=3, sliding_window=70, logits_soft_cap=7.0),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=128, num_stages=3, persistent=False)),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=256, num_stages=1), num_splits=2),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=4), num_splits=40),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=2, longest_first=True)),
    dict(config=mosaic.MosaicDecodeConfig(persistent=False), num_splits=3),
    dict(config=mosaic.MosaicDecodeConfig(persistent=False, longest_first=False)),
    dict(config=mosaic.MosaicDecodeConfig(longest_first=False), num_splits=2),
    dict(
        config=mosaic.MosaicDecodeConfig(persistent=True, block_kv=64, num_stages=4),
        num_splits=3,
        sliding_window=70,
    ),
    dict(config=mosaic.MosaicDecodeConfig(compute_warpgroups=2)),
    dict(
        config=mosaic.MosaicDecodeConfig(
            block_kv=64, num_stages=4, persistent=False, compute_warpgroups=2
        ),
        num_splits=3,
        sliding_window=70,
    ),
]


@pytest.mark.parametrize("options", LOWERING_FEATURES, ids=lambda o: "-".join(o))
def test_cross_lowers_features(options):
    args = _abstract_args(128, 32, 8, 16, jnp.bfloat16)
    assert "mosaic_gpu" in lower_for_hopper(_mosaic_fn(**options), *args)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(6, 1), (24, 2), (64, 1), (2, 2)])
def test_cross_lowers_odd_groups(num_q_heads, num_kv_heads):
    """Groups that are not a divisor or multiple of 8 start mid-tile, and q with fewer heads
    than one Q tile gets padded."""
    args = _abstract_args(64, num_q_heads, num_kv_heads, 16, jnp.float16)
    assert "mosaic_gpu" in lower_for_hopper(_mosaic_fn(), *args)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (16, 2), (24, 2)])
def test_one_split_launches_only_the_kernel(num_q_heads, num_kv_heads):
    """With one split the kernel writes the final `out` and `lse` (its group's rows at their
    heads, metadata clamped inside): no XLA op runs around it."""
    args = _abstract_args(64, num_q_heads, num_kv_heads, 16, jnp.bfloat16)
    text = lower_for_hopper(_mosaic_fn(num_splits=1), *args)
    ops = {line.split("=", 1)[-1].split()[0] for line in text.splitlines() if "stablehlo." in line}
    assert ops == {"stablehlo.custom_call"}, ops


def _custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


def test_splits_merge_in_a_mosaic_kernel():
    """With several splits, a second Mosaic GPU kernel merges the partials (no Triton kernel
    could lower here, and no XLA reduction is left)."""
    args = _abstract_args(128, 32, 8, 16, jnp.bfloat16)
    text = lower_for_hopper(_mosaic_fn(num_splits=4), *args)
    calls = _custom_calls(text)
    assert len(calls) == 2 and all("mosaic_gpu" in c for c in calls), calls
    assert "stablehlo.reduce" not in text


def test_splits_past_the_mosaic_merge_merge_in_xla(monkeypatch):
    """Partials a thread of the Mosaic merge could not hold in flight (here its limit set to
    2 loads) are merged in XLA: one custom call, the decode kernel's, and a reduction."""
    from pallas_kernels.mosaic import merge

    monkeypatch.setattr(merge, "MAX_LOADS_PER_THREAD", 2)
    args = _abstract_args(128, 32, 8, 16, jnp.bfloat16)
    text = lower_for_hopper(_mosaic_fn(num_splits=4), *args)
    assert len(_custom_calls(text)) == 1 and "mosaic_gpu" in text
    assert "stablehlo.reduce" in text


def test_cross_lowers_poisoned():
    """Poisoned outputs are refs aliased to the kernel's outputs."""
    args = _abstract_args(128, 32, 8, 64, jnp.bfloat16)
    with poison_outputs():
        text = lower_for_hopper(_mosaic_fn(num_splits=1), *args)
    assert "mosaic_gpu" in text


def test_float32_is_a_type_error():
    args = [jnp.zeros(a.shape, a.dtype) for a in _abstract_args(64, 4, 4, 16, jnp.float32)]
    with pytest.raises(TypeError, match="q.dtype=float32"):
        mosaic.paged_decode_attention(*args, sm_scale=0.125)


@pytest.mark.parametrize(
    "head_dim,page_size,num_q_heads,config,match",
    [
        (96, 16, 4, None, "multiple of 64"),
        (512, 16, 4, None, "multiple of 64 up to 256"),
        (64, 12, 4, None, "page_size"),
        (64, 256, 4, None, "page_size"),
        (64, 16, 4 * 61, None, "64-row"),
        (256, 16, 4, mosaic.MosaicDecodeConfig(block_kv=256, num_stages=2), "shared memory"),
    ],
)
def test_unsupported_shapes_are_value_errors(head_dim, page_size, num_q_heads, config, match):
    num_kv_heads = 4
    args = _abstract_args(head_dim, num_q_heads, num_kv_heads, page_size, jnp.bfloat16)
    args = [jnp.zeros(a.shape, a.dtype) for a in args]
    with pytest.raises(ValueError, match=match):
        mosaic.paged_decode_attention(*args, sm_scale=0.125, config=config)


def test_interpret_is_refused():
    args = [jnp.zeros(a.shape, a.dtype) for a in _abstract_args(64, 4, 4, 16, jnp.bfloat16)]
    with pytest.raises(NotImplementedError, match="no interpret mode"):
        mosaic.paged_decode_attention(*args, sm_scale=0.125, interpret=True)


@pytest.mark.parametrize(
    "options",
    [
        dict(block_kv=96),
        dict(block_kv=512),
        dict(num_stages=0),
        dict(compute_warpgroups=3),
        dict(compute_warpgroups=2, num_stages=3),
    ],
    ids=str,
)
def test_config_is_validated(options):
    with pytest.raises(ValueError):
        mosaic.MosaicDecodeConfig(**options)


@pytest.mark.parametrize(
    "seqs,kv_heads,max_steps,expected",
    [
        (64, 8, 32, 1),  # 512 programs already fill 132 SMs
        (8, 8, 256, 2),  # B=8, ctx 32768: 128 programs, one wave
        (1, 8, 256, 16),  # B=1, ctx 32768: 128 programs, one wave
        (1, 8, 7, 7),  # a short sequence: one step per split
        (2, 1, 16, 16),  # capped by the sequence's steps
        (2, 8, 10, 8),  # B=1 of the engine (two slots), ctx 1280: capped by the SMs
    ],
)
def test_choose_num_splits(seqs, kv_heads, max_steps, expected):
    assert mosaic.choose_num_splits(seqs, kv_heads, max_steps) == expected


@pytest.mark.parametrize(
    "head_dim,block_kv,num_stages", [(64, 128, 4), (128, 128, 2), (256, 64, 2)]
)
def test_default_config(head_dim, block_kv, num_stages):
    """Persistent and longest first, except at D=256 (the staging buffers do not fit)."""
    want = mosaic.MosaicDecodeConfig(block_kv, num_stages, persistent=head_dim <= 128)
    assert mosaic.MosaicDecodeConfig.default(head_dim) == want


def test_persistent_grid_and_order():
    """A persistent call launches one program per SM at most and orders the slots by length
    only when a program has more than one item: inside the kernel up to `MAX_SLOTS_RANKED`
    slots, by one XLA sort over kv_lens beyond."""
    # 3 slots x 8 KV heads x 1 split = 24 items: 24 programs of one item, no order.
    args = _abstract_args(128, 32, 8, 16, jnp.bfloat16)
    assert slot_order.choose(mosaic.MosaicDecodeConfig.default(128), 1, 3) is None
    assert "stablehlo.sort" not in lower_for_hopper(_mosaic_fn(num_splits=1), *args)
    # 64 slots x 8 KV heads = 512 items over at most 132 programs: ordered in the kernel.
    args = _abstract_args(128, 32, 8, 16, jnp.bfloat16, seqs=64)
    assert slot_order.choose(mosaic.MosaicDecodeConfig.default(128), 4, 64) == "kernel"
    text = lower_for_hopper(_mosaic_fn(num_splits=1), *args)
    ops = {line.split("=", 1)[-1].split()[0] for line in text.splitlines() if "stablehlo." in line}
    assert ops == {"stablehlo.custom_call"}, ops
    # More slots than the kernel ranks: one XLA sort.
    slots = slot_order.MAX_SLOTS_RANKED + 1
    args = _abstract_args(128, 32, 8, 16, jnp.bfloat16, seqs=slots)
    text = lower_for_hopper(_mosaic_fn(num_splits=1), *args)
    assert text.count("stablehlo.sort") == 1 and "stablehlo.negate" not in text
    plain = mosaic.MosaicDecodeConfig(longest_first=False)
    assert "stablehlo.sort" not in lower_for_hopper(_mosaic_fn(num_splits=1, config=plain), *args)


@pytest.mark.parametrize(
    "seqs,num_splits,persistent,programs",
    [
        (3, 1, False, 24),
        (16, 1, False, 128),
        (1, 16, False, 128),
        (17, 1, True, 132),
        (64, 1, True, 132),
    ],
)
def test_persistent_only_past_one_item_per_sm(monkeypatch, seqs, num_splits, persistent, programs):
    """The default config walks items in persistent programs only when there are more items
    than SMs; with no more, the kernel runs the grid of items (one program an item either
    way, without the walk's output staging and waits), and orders no slots: all its programs
    start at once. Persistent programs at D=128 take 64-key steps in two compute
    warpgroups; the grid keeps one warpgroup of 128-key steps."""
    seen = {}
    make_body = mosaic.decode_body.make_body

    def spy(**kwargs):
        config = kwargs["config"]
        seen.update(persistent=config.persistent, programs=kwargs["num_programs"])
        seen.update(steps=(config.block_kv, config.num_stages, config.compute_warpgroups))
        seen.update(ordering=kwargs["ordering"])
        return make_body(**kwargs)

    monkeypatch.setattr(mosaic.decode_body, "make_body", spy)
    monkeypatch.setattr(mosaic, "device_num_sms", lambda: 132)
    args = _abstract_args(128, 16, 8, 16, jnp.bfloat16, seqs=seqs, pages=seqs * 8)
    assert "mosaic_gpu" in lower_for_hopper(_mosaic_fn(num_splits=num_splits), *args)
    steps = (64, 4, 2) if persistent else (128, 2, 1)
    ordering = "kernel" if persistent else None
    assert seen == dict(persistent=persistent, programs=programs, steps=steps, ordering=ordering)


def _ranked_slots(kv_lens):
    """`order_slots` as the decode kernel runs it: the copy warpgroup ranks the slots and
    arrives on a barrier; the compute warpgroup waits on it and copies the order out."""
    num = kv_lens.shape[0]

    def body(lens_ref, out_ref, lens_smem, order_smem, ready):
        @pl.when(jax.lax.axis_index("wg") == 1)
        def _rank():
            slot_order.order_slots(lens_ref, lens_smem, order_smem)
            plgpu.barrier_arrive(ready)

        @pl.when(jax.lax.axis_index("wg") == 0)
        def _copy_out():
            plgpu.barrier_wait(ready)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(order_smem, out_ref)
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num,), jnp.int32),
        scratch_types=(
            plgpu.SMEM((num,), jnp.int32),
            plgpu.SMEM((num,), jnp.int32),
            plgpu.Barrier(),
        ),
        num_threads=2,
        thread_name="wg",
    )(kv_lens)


def test_ranking_cross_lowers():
    lens = jax.ShapeDtypeStruct((132,), jnp.int32)
    assert "mosaic_gpu" in lower_for_hopper(_ranked_slots, lens)


# ---------------------------------------------------------------------------- on the H200


def _run(batch, **options):
    with poison_outputs():
        return jaxpaged.paged_decode_attention(
            batch.q,
            batch.k_pages,
            batch.v_pages,
            batch.kv_lens,
            batch.page_indices,
            return_lse=True,
            implementation="mosaic",
            **options,
        )


def _decode_batch(rng, lens, **kw):
    return make_batch(rng, [(1, n) for n in lens], pad_tokens=0, pad_seqs=0, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_shapes(shape, dtype):
    head_dim, (num_q_heads, num_kv_heads), page_size = shape
    rng = np.random.default_rng(head_dim + page_size + num_q_heads)
    lens = [0, 1, page_size - 1, page_size + 1, 64, 65, 200, 3 * page_size + 5]
    batch = _decode_batch(
        rng,
        lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    out, lse = _run(batch)
    assert_close(out, lse, *oracle(batch), dtype)


FEATURES = [
    dict(),
    dict(sliding_window=1),
    dict(sliding_window=70),
    dict(logits_soft_cap=2.5),
    dict(sm_scale=0.3, sliding_window=19, logits_soft_cap=7.0),
    dict(num_splits=1),
    dict(num_splits=5),
    dict(num_splits=3, sliding_window=100),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=4)),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=256, num_stages=1), num_splits=2),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=1)),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=4), num_splits=40),
    dict(config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=2, longest_first=True)),
    dict(config=mosaic.MosaicDecodeConfig(longest_first=True), num_splits=3),
    dict(config=mosaic.MosaicDecodeConfig(persistent=False), num_splits=3),
    dict(config=mosaic.MosaicDecodeConfig(persistent=False, longest_first=False), num_splits=1),
    dict(config=mosaic.MosaicDecodeConfig(longest_first=False), num_splits=3),
    dict(
        config=mosaic.MosaicDecodeConfig(persistent=True, block_kv=64, num_stages=4),
        num_splits=5,
        sliding_window=70,
    ),
    dict(config=mosaic.MosaicDecodeConfig(compute_warpgroups=2)),
    dict(config=mosaic.MosaicDecodeConfig(compute_warpgroups=2, persistent=False), num_splits=3),
    dict(
        config=mosaic.MosaicDecodeConfig(block_kv=64, num_stages=4, compute_warpgroups=2),
        num_splits=5,
        sliding_window=70,
        logits_soft_cap=7.0,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_features(features, page_size):
    """Windows, soft cap, scale, forced split counts and configs, with inactive slots and NaN in
    every unused page and page slot."""
    rng = np.random.default_rng(page_size)
    lens = [0, 1, 2, 63, 64, 65, page_size + 1, 5 * page_size + 7, 300, 0]
    batch = _decode_batch(
        rng,
        lens,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.bfloat16,
    )
    features = {**features}
    options = {
        k: features[k] for k in ("sm_scale", "sliding_window", "logits_soft_cap") if k in features
    }
    out, lse = _run(batch, **features)
    assert_close(out, lse, *oracle(batch, **options), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("compute_warpgroups", [1, 2])
@pytest.mark.parametrize("page_size", [16, 64])
def test_long_context(page_size, compute_warpgroups):
    """Thousands of steps per sequence over scattered pages, split across programs."""
    rng = np.random.default_rng(3)
    batch = _decode_batch(
        rng,
        [20000, 4099, 1, 0],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.bfloat16,
    )
    config = mosaic.MosaicDecodeConfig(compute_warpgroups=compute_warpgroups)
    out, lse = _run(batch, config=config)
    assert_close(out, lse, *oracle(batch), jnp.bfloat16)


def _ragged_batch(rng, lens, **heads):
    """A bf16 batch of one decode token per slot over pages of 16 tokens."""
    return _decode_batch(rng, lens, page_size=16, dtype=jnp.bfloat16, **heads)


@pytest.mark.gpu
@pytest.mark.parametrize("compute_warpgroups", [1, 2])
@pytest.mark.parametrize("longest_first", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_persistent_programs_walk_many_items(num_splits, longest_first, compute_warpgroups):
    """48 ragged slots x 4 KV heads x splits: up to 5 items per persistent program, whose
    K/V pipeline runs on from one item into the next (with two compute warpgroups, items of
    odd step counts swap which warpgroup takes the next item's first step)."""
    rng = np.random.default_rng(num_splits)
    lens = [int(n) for n in rng.integers(0, 700, size=48)]
    batch = _ragged_batch(rng, lens, num_q_heads=16, num_kv_heads=4, head_dim=128)
    config = mosaic.MosaicDecodeConfig(
        persistent=True, longest_first=longest_first, compute_warpgroups=compute_warpgroups
    )
    out, lse = _run(batch, num_splits=num_splits, config=config)
    assert_close(out, lse, *oracle(batch), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_slots", [4, 132, 200, 256])
def test_ranking_is_longest_first(num_slots):
    """Every slot once, by decreasing kv_len, ties by slot: up to two slots per thread, with
    repeated lengths, zeros and a length past the page table (ranked as given)."""
    rng = np.random.default_rng(num_slots)
    lens = rng.integers(0, 40, size=num_slots).astype(np.int32)
    lens[-1] = 10**6
    got = np.asarray(jax.jit(_ranked_slots)(jnp.asarray(lens)))
    np.testing.assert_array_equal(got, np.lexsort((np.arange(num_slots), -lens)))


@pytest.mark.gpu
@pytest.mark.parametrize("num_slots", [100, slot_order.MAX_SLOTS_RANKED + 4])
def test_many_slots_ordered(num_slots):
    """Ragged slots with repeated lengths and inactive ones, several items per program:
    ordered inside the kernel (100 slots) or by XLA's sort (more than it ranks)."""
    rng = np.random.default_rng(num_slots)
    lens = [int(n) for n in rng.choice([0, 1, 17, 64, 130, 300], size=num_slots)]
    batch = _ragged_batch(rng, lens, num_q_heads=8, num_kv_heads=2, head_dim=64)
    out, lse = _run(batch)
    assert_close(out, lse, *oracle(batch), jnp.bfloat16)


@pytest.mark.gpu
def test_all_slots_inactive():
    rng = np.random.default_rng(4)
    batch = _decode_batch(
        rng, [0, 0, 0], num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.float16
    )
    out, lse = _run(batch)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), 0.0)
    assert np.isneginf(np.asarray(lse)).all()


# `rope_append_decode_attention`: a decode step's `rope_append` and attention in one kernel.


def _rope_inputs(rng, batch, group, partial, qk_norm):
    """qkv (in the pages' dtype, or float32 partial sums of 3 parts), cos, sin, the scales and
    the slots of the new tokens (-1 for an empty slot but the last, which writes to a spare
    slot of an unused page), with the pages at the new tokens' slots set to NaN: the kernel
    must not read what the pages held there."""
    num_seqs = batch.kv_lens.shape[0]
    num_pages, page_size, num_kv_heads, head_dim = batch.k_pages.shape
    dtype = batch.k_pages.dtype
    shape = (num_seqs, num_kv_heads, group + 2, head_dim)
    qkv = 2 * rng.standard_normal((3, *shape) if partial else shape)
    qkv = jnp.asarray(qkv, jnp.float32 if partial else dtype)
    lens, table = np.asarray(batch.kv_lens), np.asarray(batch.page_indices)
    last = np.maximum(lens, 1) - 1
    slots = np.where(lens > 0, table[np.arange(num_seqs), last // page_size] * page_size, -1)
    slots = np.where(lens > 0, slots + last % page_size, -1)
    spare = np.setdiff1d(np.arange(num_pages), table[lens > 0].ravel())
    empty = np.flatnonzero(lens == 0)
    if len(empty) and len(spare):
        slots[empty[-1]] = spare[0] * page_size + 1
    k, v = np.array(batch.k_pages), np.array(batch.v_pages)
    live = slots[slots >= 0]
    for pages in (k, v):
        pages.reshape(-1, num_kv_heads, head_dim)[live] = np.nan
    positions = jnp.asarray(last, jnp.int32)
    freq = jaxpaged.rope_frequencies(head_dim, 1e6)
    angles = positions.astype(jnp.float32)[:, None] * freq
    scales = (
        tuple(jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), dtype) for _ in range(2))
        if qk_norm
        else (None, None)
    )
    return (
        qkv,
        jnp.cos(angles),
        jnp.sin(angles),
        *scales,
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(slots, jnp.int32),
        positions,
    )


def _fold_fn(**options):
    options = {"eps": 1e-6, "sm_scale": 0.125, **options}
    return lambda *args: mosaic.rope_append_decode_attention(*args, **options)


@pytest.mark.parametrize(
    "partial,dtype,group,head_dim,qk_norm,splits",
    [
        (True, jnp.bfloat16, 2, 128, True, 1),
        (False, jnp.float16, 1, 256, False, 4),  # the merge kernel after it
        (True, jnp.bfloat16, 8, 64, True, 2),
    ],
)
def test_rope_fold_cross_lowers(partial, dtype, group, head_dim, qk_norm, splits):
    """One Mosaic GPU kernel (and the Mosaic merge with several splits), no Triton one, its
    page outputs aliased to the page operands."""
    num_seqs, num_kv_heads, page_size = 3, 2, 16
    shape = (num_seqs, num_kv_heads, group + 2, head_dim)
    qkv = jax.ShapeDtypeStruct((4, *shape) if partial else shape, jnp.float32 if partial else dtype)
    angles = jax.ShapeDtypeStruct((num_seqs, head_dim // 2), jnp.float32)
    scale = jax.ShapeDtypeStruct((head_dim,), dtype) if qk_norm else None
    pages = jax.ShapeDtypeStruct((40, page_size, num_kv_heads, head_dim), dtype)
    vector = jax.ShapeDtypeStruct((num_seqs,), jnp.int32)
    # A table of 8 pages a row: 128 keys, one step of 128 (D <= 128) or two of 64.
    table = jax.ShapeDtypeStruct((num_seqs, 8 * splits), jnp.int32)
    text = lower_for_hopper(
        _fold_fn(), qkv, angles, angles, scale, scale, pages, pages, vector, vector, table
    )
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert all("@mosaic_gpu" in call for call in calls) and len(calls) == 1 + (splits > 1), calls
    aliased = re.findall(r"operand_index = (\d+)", calls[0])
    num_front = 4 + 2 * qk_norm
    assert sorted(map(int, aliased)) == [num_front, num_front + 1], calls[0]


def test_rope_fold_takes_a_grid_of_items_and_head_dims_of_64_128_256():
    """Persistent programs (more (sequence, KV head) pairs than SMs) and D=192 (whose lanes'
    elements straddle the swizzle's 16-byte chunks) run `rope_append` apart."""
    assert mosaic.folds_rope(16, 8, 128) and mosaic.folds_rope(1, 8, 64)
    assert not mosaic.folds_rope(64, 8, 128) and not mosaic.folds_rope(1, 8, 192)
    qkv = jnp.ones((64, 8, 4, 128), jnp.bfloat16)
    angles = jnp.ones((64, 64), jnp.float32)
    pages = jnp.zeros((4, 16, 8, 128), jnp.bfloat16)
    lens = jnp.ones((64,), jnp.int32)
    with pytest.raises(ValueError, match="at most one \\(sequence, KV head\\) pair per SM"):
        _fold_fn()(qkv, angles, angles, None, None, pages, pages, lens, lens, lens[:, None])


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kv_lens=np.ones(4, np.int32)), "kv_lens must have one row per sequence slot"),
        (dict(slots=np.ones(2, np.int32)), "slots must have one row"),
        (dict(qkv=np.ones((3, 2, 4, 128), np.float16)), "float32 partial sums or in the pages"),
        (dict(qkv=jnp.ones((3, 4, 4, 128), jnp.bfloat16)), "the pages' \\(Hkv, D\\)"),
        (dict(cos=np.ones((3, 32), np.float32)), "cos and sin must be"),
        (dict(q_scale=np.ones(128, np.float32)), "q_scale and k_scale go together"),
    ],
)
def test_rope_fold_rejects_bad_arguments(change, match):
    """Shapes checked before tracing: a kv_lens, slot or page-table row per qkv token."""
    args = dict(
        qkv=jnp.ones((3, 2, 4, 128), jnp.bfloat16),
        cos=np.ones((3, 64), np.float32),
        sin=np.ones((3, 64), np.float32),
        q_scale=None,
        k_scale=None,
        k_pages=jnp.zeros((8, 16, 2, 128), jnp.bfloat16),
        v_pages=jnp.zeros((8, 16, 2, 128), jnp.bfloat16),
        slots=np.ones(3, np.int32),
        kv_lens=np.ones(3, np.int32),
        page_indices=np.zeros((3, 2), np.int32),
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        _fold_fn()(*(jnp.asarray(a) if a is not None else None for a in args.values()))


FOLD_CASES = [
    # partial, dtype, group, head_dim, page_size, qk_norm, options
    (True, jnp.bfloat16, 2, 128, 16, True, {}),
    (False, jnp.bfloat16, 4, 64, 16, False, {}),
    (True, jnp.float16, 1, 256, 16, True, {}),
    (True, jnp.bfloat16, 8, 128, 64, True, {}),
    (False, jnp.float16, 3, 128, 16, True, dict(sliding_window=70)),
    (True, jnp.bfloat16, 2, 128, 16, False, dict(sliding_window=1, logits_soft_cap=7.0)),
    (True, jnp.bfloat16, 16, 64, 64, True, dict(logits_soft_cap=2.5)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "partial,dtype,group,head_dim,page_size,qk_norm,options",
    FOLD_CASES,
    ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else None,
)
def test_rope_fold_matches_rope_append_then_attention(
    partial, dtype, group, head_dim, page_size, qk_norm, options
):
    """Against `rope_append` (the Mosaic GPU kernel) then the float64 oracle over its q and
    pages: the same pages bit for bit (the fold runs the same per-lane code), and attention
    within the dtype's tolerance. Lengths cover an empty slot (one writing to a spare page,
    one writing nothing), the new key alone, step and page boundaries and several splits;
    the new tokens' slots hold NaN before the call and unused pages NaN throughout."""
    rng = np.random.default_rng(group * head_dim + page_size)
    lens = [0, 1, 2, page_size, page_size + 1, 64, 65, 127, 128, 129, 300, 1000, 0]
    num_kv_heads = 2
    batch = _decode_batch(
        rng,
        lens,
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    qkv, cos, sin, q_scale, k_scale, k_pages, v_pages, slots, positions = _rope_inputs(
        rng, batch, group, partial, qk_norm
    )
    with poison_outputs():
        out, lse, got_k, got_v = jax.jit(_fold_fn(**options))(
            qkv,
            cos,
            sin,
            q_scale,
            k_scale,
            k_pages,
            v_pages,
            slots,
            batch.kv_lens,
            batch.page_indices,
        )
        q, want_k, want_v = jax.jit(functools.partial(rope_append_kernel.rope_append, eps=1e-6))(
            qkv, cos, sin, q_scale, k_scale, k_pages, v_pages, slots
        )
    for got, want in ((got_k, want_k), (got_v, want_v)):  # NaN == NaN: the untouched pages
        np.testing.assert_array_equal(*(np.asarray(a.astype(jnp.float32)) for a in (got, want)))
    written = dataclasses.replace(batch, q=q, k_pages=want_k, v_pages=want_v)
    assert_close(out, lse, *oracle(written, sm_scale=0.125, **options), dtype)
