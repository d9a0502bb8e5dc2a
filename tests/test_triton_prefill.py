"""The Triton ragged prefill kernel: its lowering for CUDA (run on this GPU-less machine), its
block plan, compiling once per padded size, and the tile and page geometry against the float64
oracle. Features (window, soft cap, scale) for every backend are in test_attention.py.

Without a GPU the kernel runs in Pallas interpret mode on small batches; the `gpu` marker runs
large batches and every tuning variant below compiled on the H200.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from pallas_kernels.block_plan import plan_blocks, plan_short_sequences
from pallas_kernels.common import poison_outputs, sanitize_metadata
from pallas_kernels.triton import ragged_prefill
from pallas_kernels.triton.ragged_prefill import PrefillConfig
from tests.helpers import (
    LSE_TOL,
    OUT_TOL,
    assert_close,
    latin_square,
    live_tokens,
    lower_for_cuda,
    make_batch,
    oracle,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_ORACLE_OPTIONS = ("sm_scale", "causal", "sliding_window", "logits_soft_cap")


def _run(batch, implementation="triton", **kw):
    """The kernel through the public op, with NaN-poisoned output buffers."""
    with poison_outputs():
        return jaxpaged.ragged_paged_attention(
            *batch.args(), return_lse=True, implementation=implementation, **kw
        )


def _check(batch, dtype, **kw):
    out, lse = _run(batch, **kw)
    options = {k: v for k, v in kw.items() if k in _ORACLE_OPTIONS}
    assert_close(out, lse, *oracle(batch, **options), dtype)


# --- lowering for CUDA ------------------------------------------------------------------------


@contextlib.contextmanager
def _capture_triton_ir():
    """Collect the Triton IR text of every kernel lowered inside the context."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    texts = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield texts
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def _abstract_args(*, num_q_heads, num_kv_heads, head_dim, page_size, dtype):
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    pages = jax.ShapeDtypeStruct((40, page_size, num_kv_heads, head_dim), dtype)
    return (
        jax.ShapeDtypeStruct((96, num_q_heads, head_dim), dtype),
        pages,
        pages,
        i32(5),
        i32(5, 9),
        i32(6),
        i32(),
    )


# Every pair of (head dim, heads, dtype) values in nine cases, and below every pair of (page
# size, features, page-id config) in four launches: a lowering that fails does so for a value or
# a pair of them. On CI's two cores the whole 27 x 8 product took 84 s (session 26); the H200
# runs every kernel shape for real (`pytest -m gpu`).
LOWERING_SHAPES = [
    pytest.param(d, h, dt, id=f"{d}-hq{h[0]}-hkv{h[1]}-{jnp.dtype(dt).name}")
    for d, h, dt in latin_square((64, 128, 256), ((8, 8), (8, 2), (8, 1)), DTYPES)
]


@pytest.mark.parametrize(("head_dim", "heads", "dtype"), LOWERING_SHAPES)
def test_lowers_for_cuda(head_dim, heads, dtype):
    """Every supported shape lowers to Triton IR for sm_90, float32 dots as IEEE (no TF32), with
    the page ids of K/V tiles looked up either way (`carry_page_ids`) in both launches."""
    num_q_heads, num_kv_heads = heads
    default = PrefillConfig.default(head_dim, dtype)
    flipped = dataclasses.replace(
        default,
        carry_page_ids=not default.carry_page_ids,
        short_carry_page_ids=not default.short_carry_page_ids,
    )
    plain, every = dict(), dict(sliding_window=37, logits_soft_cap=20.0, causal=False)
    for page_size, features, config in [
        (16, plain, default),
        (16, every, flipped),
        (64, plain, flipped),
        (64, every, default),
    ]:
        args = _abstract_args(
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
        )
        fn = functools.partial(
            ragged_prefill.ragged_paged_attention, sm_scale=0.1, config=config, **features
        )
        with _capture_triton_ir() as texts:
            hlo = lower_for_cuda(fn, *args)
        assert "ragged_paged_prefill_short" in hlo
        assert len(texts) == 2  # the launches for long and for short sequences
        for ir in texts:
            assert ir.count("tt.dot ") == 4  # QK and PV, in the unmasked and the masked loop
            assert "tf32" not in ir


def test_head_dim_and_config_are_checked():
    batch = make_batch(np.random.default_rng(0), [(3, 5)], head_dim=32)
    with pytest.raises(ValueError, match=r"q's head dim D in \(64, 128, 256\).*D = 32"):
        jaxpaged.ragged_paged_attention(*batch.args(), implementation="triton")
    for bad in (
        dict(block_q=48),
        dict(block_kv=8),
        dict(num_warps=3),
        dict(num_stages=0),
        dict(short_block_q=8),
        dict(short_block_kv=24),
        dict(short_num_warps=6),
        dict(short_num_stages=0),
    ):
        with pytest.raises(ValueError, match="PrefillConfig"):
            PrefillConfig(**bad)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_default_config(head_dim, dtype):
    config = PrefillConfig.default(head_dim, dtype)  # valid: construction checks
    assert config.num_warps in (4, 8)


# --- the plan -------------------------------------------------------------------------------


def _plan(batch, *, tokens, block_kv, short_tokens=0, causal=True, sliding_window=None, align=1):
    """The columns of the long-sequence plan, then those of the short one (if any)."""
    num_tokens = batch.q.shape[0]
    meta = sanitize_metadata(
        batch.kv_lens,
        batch.page_indices,
        batch.cu_q_lens,
        batch.num_seqs,
        num_tokens=num_tokens,
        num_pages=batch.k_pages.shape[0],
        page_size=batch.k_pages.shape[1],
    )
    options = dict(block_kv=block_kv, causal=causal, sliding_window=sliding_window)
    plans = [
        plan_blocks(
            meta.cu_q_lens,
            meta.kv_lens,
            num_tokens=num_tokens,
            tokens=tokens,
            skip_up_to=short_tokens,
            align=align,
            **options,
        )
    ]
    if short_tokens:
        plans.append(
            plan_short_sequences(meta.cu_q_lens, meta.kv_lens, tokens=short_tokens, **options)
        )
    return [np.asarray(p) for p in plans], np.asarray(meta.kv_lens)


@pytest.mark.parametrize(
    "tokens,short_tokens,block_kv,align",
    # align 8: the Mosaic GPU prefill kernel's plan (blocks of 128 rows from multiples of 8)
    [(1, 0, 16, 1), (4, 2, 16, 1), (8, 0, 64, 1), (32, 4, 32, 1), (16, 2, 32, 8), (128, 4, 128, 8)],
)
@pytest.mark.parametrize(
    "options",
    [dict(), dict(sliding_window=9), dict(causal=False), dict(causal=False, sliding_window=30)],
    ids=str,
)
def test_plan_covers_every_token_once_and_every_visible_key(
    tokens, short_tokens, block_kv, align, options
):
    """Each token (padding included) is in exactly one block of the two launches; a block's
    tiles hold every key that one of its tokens sees; tiles outside [full_lo, full_hi) are the
    only ones with masks."""
    rng = np.random.default_rng(tokens * block_kv)
    seqs = [(1, 70), (9, 41), (33, 33), (0, 5), (0, 0), (17, 100), (2, 2), (64, 64), (5, 200)]
    batch = make_batch(rng, seqs, pad_tokens=7, pad_seqs=2)
    plans, kv = _plan(
        batch, tokens=tokens, short_tokens=short_tokens, block_kv=block_kv, align=align, **options
    )
    causal = options.get("causal", True)
    window = options.get("sliding_window")
    num_tokens = batch.q.shape[0]
    seen = np.zeros(num_tokens, int)
    for seq, first, count, pos, kv_len, tile_lo, full_lo, full_hi, tile_hi in np.concatenate(
        plans, axis=1
    ).T:
        # A block's rows start at `first` rounded down to `align`; its tokens fit after that.
        assert 0 <= seq < len(kv) and 0 <= count <= tokens - first % align
        assert tile_lo <= full_lo <= full_hi <= tile_hi
        seen[first : first + count] += 1
        if count == 0:
            assert tile_lo == tile_hi
            continue
        q_pos = pos + np.arange(count)[:, None]
        keys = np.arange(max(kv_len, 1) + block_kv)[None, :]
        ok = np.broadcast_to(keys < kv_len, (count, keys.size)).copy()
        if causal:
            ok &= keys <= q_pos
        if window is not None:
            ok &= keys > q_pos - window
        tile_of_key = keys[0] // block_kv
        assert not ok[:, (tile_of_key < tile_lo) | (tile_of_key >= tile_hi)].any()
        full = (tile_of_key >= full_lo) & (tile_of_key < full_hi)
        assert ok[:, full].all()
    np.testing.assert_array_equal(seen, 1)
    # Long blocks run longest first: the last block of each sequence before its first.
    live = plans[0][2] > 0
    assert (np.diff(plans[0][1][live]) < 0).all()
    if short_tokens:
        assert plans[1][2].max() <= short_tokens


def test_plan_skips_tiles_outside_the_window():
    """A short chunk on a long prefix with a window visits only the tiles of its window."""
    batch = make_batch(np.random.default_rng(1), [(4, 1000)], pad_tokens=0, pad_seqs=0)
    [plan], _ = _plan(batch, tokens=8, block_kv=32, sliding_window=50)
    [[_, _, count, pos, _, tile_lo, _, _, tile_hi]] = plan.T[plan[2] > 0]
    assert (count, pos) == (4, 996)
    assert (tile_lo, tile_hi) == ((996 - 49) // 32, 1000 // 32 + 1)


# --- compiling once ---------------------------------------------------------------------------


def test_compiles_once_per_padded_size():
    """Two batches of different content (lengths, num_seqs) but the same padded sizes share one
    compiled program, and both are right."""
    rng = np.random.default_rng(2)
    a = make_batch(rng, [(5, 20), (3, 3), (9, 30)], pad_tokens=4, pad_seqs=1, spare_pages=2)
    b = make_batch(rng, [(1, 32), (19, 19)], pad_tokens=1, pad_seqs=2, spare_pages=3)
    for x, y in zip(a.args(), b.args(), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
    # The first Pallas call of a process imports a JAX module that adds a tracing-context flag,
    # so everything traced before it traces once more: warm up outside the count.
    _run(a)
    traces = []

    @jax.jit
    def attend(*args):
        traces.append(1)
        return jaxpaged.ragged_paged_attention(*args, return_lse=True, implementation="triton")

    with poison_outputs():
        results = [attend(*batch.args()) for batch in (a, b)]
    assert len(traces) == 1 and attend._cache_size() == 1
    for batch, (out, lse) in zip((a, b), results, strict=True):
        assert_close(out, lse, *oracle(batch), jnp.float32)


# --- tile and page geometry (interpret mode) --------------------------------------------------


@pytest.mark.parametrize(
    "page_size,config",
    [
        (16, PrefillConfig(block_q=64, block_kv=64)),  # 4 pages per K/V tile
        (16, PrefillConfig(block_q=64, block_kv=64, carry_page_ids=True)),
        (64, PrefillConfig(block_q=32, block_kv=16)),  # 4 K/V tiles per page
        (64, PrefillConfig(block_q=32, block_kv=16, carry_page_ids=True)),
        (16, PrefillConfig(block_q=16, block_kv=16)),  # a page per tile, 8 tokens per block
        (16, PrefillConfig(block_q=64, block_kv=32, short_block_q=0)),  # one launch for all
        # Sequences of up to 16 tokens in the short launch, its tiles smaller than a page.
        (64, PrefillConfig(block_q=64, block_kv=64, short_block_q=32, short_block_kv=16)),
        (
            64,
            PrefillConfig(
                block_q=64,
                block_kv=64,
                short_block_q=32,
                short_block_kv=16,
                short_carry_page_ids=False,
            ),
        ),
    ],
    ids=[
        "page<tile",
        "page<tile-carried",
        "page>tile",
        "page>tile-carried",
        "page=tile",
        "one-launch",
        "short<page",
        "short<page-looked-up",
    ],
)
def test_pages_and_tiles(page_size, config):
    """q blocks that span several pages, a prompt over several q blocks, tiles smaller and
    larger than a page, decode tokens and chunks on prefixes, in one or two launches."""
    rng = np.random.default_rng(page_size)
    seqs = [
        (70, 70),
        (1, 3 * page_size + 5),
        (2 * page_size + 1, 5 * page_size),
        (0, 9),
        (1, 1),
        (page_size, page_size),
    ]
    batch = make_batch(
        rng, seqs, num_q_heads=8, num_kv_heads=4, page_size=page_size, pad_tokens=5, pad_seqs=2
    )
    _check(batch, jnp.float32, config=config)


@pytest.mark.parametrize("pad_tokens", [0, 16])
def test_blocks_end_exactly_at_sequence_ends(pad_tokens):
    """Sequences whose lengths are whole numbers of q blocks (16 tokens here), with and without
    padding tokens after them."""
    rng = np.random.default_rng(pad_tokens)
    batch = make_batch(
        rng, [(16, 16), (32, 50), (16, 100), (1, 16)], pad_tokens=pad_tokens, pad_seqs=0
    )
    config = PrefillConfig(block_q=32, block_kv=16)  # 2 KV heads of 2: 16 tokens per block
    _check(batch, jnp.float32, config=config)
    out, _ = _run(batch, config=config)
    assert not np.asarray(out[live_tokens(batch) :]).any()


def test_window_skips_whole_tiles_of_a_long_prefix():
    rng = np.random.default_rng(3)
    batch = make_batch(rng, [(6, 300), (1, 250), (40, 240)], pad_tokens=2)
    _check(batch, jnp.float32, sliding_window=20, config=PrefillConfig(block_q=32, block_kv=16))


@pytest.mark.parametrize("heads", [(6, 2), (3, 1), (16, 1)], ids=lambda h: f"hq{h[0]}-hkv{h[1]}")
def test_groups_padded_to_a_power_of_two(heads):
    """Groups of 3 query heads run as 4 rows (the extra row masked); 16 heads fill a block."""
    num_q_heads, num_kv_heads = heads
    rng = np.random.default_rng(num_q_heads)
    batch = make_batch(
        rng,
        [(5, 21), (1, 40), (12, 12)],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        dtype=jnp.bfloat16,
    )
    _check(batch, jnp.bfloat16, logits_soft_cap=10.0, config=PrefillConfig(block_q=16))


def test_invalid_metadata_runs():
    """Lengths past the page table, cu_q_lens past T and num_seqs past S inside jit give numbers
    (maybe wrong, maybe NaN from unused pages) but every read and write stays in bounds: on the
    GPU a stray access would fault."""
    rng = np.random.default_rng(4)
    batch = make_batch(rng, [(5, 20), (3, 7)], pad_seqs=1)
    kv_lens = batch.kv_lens.at[0].set(10**6)
    cu = batch.cu_q_lens.at[2].set(10**6)
    attend = jax.jit(
        functools.partial(
            ragged_prefill.ragged_paged_attention,
            sm_scale=0.125,
            interpret=jax.default_backend() != "gpu",
        )
    )
    out, lse = attend(
        batch.q,
        batch.k_pages,
        batch.v_pages,
        kv_lens,
        batch.page_indices,
        cu,
        jnp.asarray(7, jnp.int32),
    )
    jax.block_until_ready((out, lse))
    assert out.shape == batch.q.shape and lse.shape == batch.q.shape[:2]


# --- compiled on the H200 ---------------------------------------------------------------------


def _reference(batch, **kw):
    return jaxpaged.ragged_paged_attention(
        *batch.args(), return_lse=True, implementation="xla", **kw
    )


def _check_against_reference(batch, dtype, **kw):
    """Large batches: the XLA reference (float32, HIGHEST precision) stands in for the float64
    loop, which would take minutes. Both are within the dtype's tolerance of exact. `kw` may
    name another `implementation` (the Mosaic GPU kernel's tests use this too)."""
    out, lse = _run(batch, **kw)
    options = {k: v for k, v in kw.items() if k in _ORACLE_OPTIONS}
    ref_out, ref_lse = _reference(batch, **options)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(
        out, np.asarray(ref_out.astype(jnp.float32)), atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype]
    )
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(
        np.asarray(lse)[finite],
        np.asarray(ref_lse)[finite],
        atol=LSE_TOL[dtype],
        rtol=LSE_TOL[dtype],
    )


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_mixed_batch(head_dim, dtype):
    """A served step: prompts, chunks on long prefixes, decode tokens and padding, with the
    default config of every head dim and dtype (float32 checks the IEEE FMA path)."""
    rng = np.random.default_rng(head_dim)
    seqs = [(1000, 1000), (512, 2048 + 512), (300, 5000), (0, 77)] + [
        (1, int(n)) for n in rng.integers(1, 3000, size=40)
    ]
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=head_dim,
        page_size=64,
        dtype=dtype,
        pad_tokens=37,
        pad_seqs=3,
    )
    _check_against_reference(batch, dtype)
    if dtype == jnp.bfloat16:  # the window's edge tiles and the soft cap, once per head dim
        _check_against_reference(batch, dtype, sliding_window=700, logits_soft_cap=30.0)


_DEFAULT = PrefillConfig.default(128, jnp.bfloat16)
# Tuning variants once swept on the H200 (benchmarks/NOTES.md), kept valid: long-launch tiles
# (block_kv, num_stages, carry_page_ids) and short-launch tiles (the same three for the
# short launch), each changed from the default.
CONFIG_VARIANTS = tuple(
    dataclasses.replace(_DEFAULT, block_kv=k, num_stages=s, carry_page_ids=c)
    for k, s, c in [
        (128, 3, False),
        (64, 3, False),
        (64, 5, False),
        (64, 8, False),
        (128, 3, True),
        (64, 3, True),
    ]
) + tuple(
    dataclasses.replace(_DEFAULT, short_block_kv=k, short_num_stages=s, short_carry_page_ids=c)
    for k, s, c in [(64, 2, True), (64, 5, False)]
)


def _config_id(c: PrefillConfig) -> str:
    carried = {True: "-carried", False: ""}
    return (
        f"q{c.block_q}-kv{c.block_kv}-w{c.num_warps}-s{c.num_stages}{carried[c.carry_page_ids]}"
        f"-short{c.short_block_q}-kv{c.short_block_kv}-w{c.short_num_warps}"
        f"-s{c.short_num_stages}{carried[c.short_carry_page_ids]}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIG_VARIANTS, ids=_config_id)
def test_gpu_config_variants(config):
    """Every tuning variant compiles and is right, in both launches."""
    rng = np.random.default_rng(5)
    seqs = [(2048, 2048), (300, 1500), (1, 900), (3, 700), (1, 64), (2, 129), (6, 6)]
    batch = make_batch(
        rng, seqs, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, dtype=jnp.bfloat16
    )
    _check_against_reference(batch, jnp.bfloat16, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_gpu_long_causal_prefill(page_size):
    rng = np.random.default_rng(page_size)
    batch = make_batch(
        rng,
        [(8192, 8192)],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.bfloat16,
        pad_tokens=0,
        pad_seqs=0,
    )
    _check_against_reference(batch, jnp.bfloat16)
