"""The Mosaic GPU ragged prefill kernel (pallas_kernels/mosaic/ragged_prefill.py).

Without a GPU: the Pallas -> Mosaic GPU lowering (layout inference and dialect lowering, not
ptxas or a launch; no Triton kernel could lower here) runs here for the supported shapes and
features, the decode tokens' Mosaic GPU decode kernel included; plus the checks before
tracing. With a GPU (`-m gpu`): results against the float64 loop of tests/helpers (small
batches) or the XLA reference (large ones). The shared ragged bodies in
tests/test_attention.py run this kernel too (backend "mosaic-gpu"). Its block plan is tested
with the Triton kernel's (`test_plan_covers_every_token_once_and_every_visible_key`, align 8).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from jaxpaged.reference import paged_decode_attention_reference
from pallas_kernels.common import poison_outputs, sanitize_metadata
from pallas_kernels.mosaic import ragged_prefill as mosaic
from tests.helpers import assert_close, lower_for_hopper, make_batch, oracle
from tests.test_triton_prefill import _check_against_reference

HEADS = [(4, 4), (16, 4), (16, 2)]  # (Hq, Hkv): GQA groups 1, 4, 8
SHAPES = list(itertools.product([64, 128, 256], HEADS, [16, 64]))
_ORACLE_OPTIONS = ("sm_scale", "causal", "sliding_window", "logits_soft_cap")


def _shape_id(shape):
    head_dim, (num_q_heads, num_kv_heads), page_size = shape
    return f"d{head_dim}-hq{num_q_heads}-hkv{num_kv_heads}-ps{page_size}"


def _abstract_args(head_dim, num_q_heads, num_kv_heads, page_size, dtype, *, tokens=300):
    seqs, pages, pages_per_seq = 4, 64, 16
    kv = jax.ShapeDtypeStruct((pages, page_size, num_kv_heads, head_dim), dtype)
    i32 = jnp.int32
    return (
        jax.ShapeDtypeStruct((tokens, num_q_heads, head_dim), dtype),
        kv,
        kv,
        jax.ShapeDtypeStruct((seqs,), i32),
        jax.ShapeDtypeStruct((seqs, pages_per_seq), i32),
        jax.ShapeDtypeStruct((seqs + 1,), i32),
        jax.ShapeDtypeStruct((1,), i32),
    )


def _mosaic_fn(**options):
    options.setdefault("sm_scale", 0.125)
    return lambda *args: mosaic.ragged_paged_attention(*args, **options)


# --- lowering for CUDA ------------------------------------------------------------------------

LOWERING_CASES = [
    ((128, (32, 8), 64), jnp.bfloat16, dict(), 8192),
    ((64, (4, 4), 16), jnp.float16, dict(sliding_window=5), 300),
    ((256, (16, 2), 16), jnp.bfloat16, dict(logits_soft_cap=3.0, causal=False), 301),
    ((128, (16, 4), 64), jnp.bfloat16, dict(sliding_window=300), 64),
    (
        (128, (32, 8), 16),
        jnp.bfloat16,
        dict(config=mosaic.MosaicPrefillConfig(block_kv=64, num_stages=3, short_sequences=False)),
        517,
    ),
    ((128, (32, 8), 16), jnp.bfloat16, dict(short_sequences=False), 64),
]


@pytest.mark.parametrize(
    "shape,dtype,options,tokens",
    LOWERING_CASES,
    ids=lambda x: _shape_id(x) if isinstance(x, tuple) else None,
)
def test_cross_lowers(shape, dtype, options, tokens):
    head_dim, (num_q_heads, num_kv_heads), page_size = shape
    args = _abstract_args(head_dim, num_q_heads, num_kv_heads, page_size, dtype, tokens=tokens)
    text = lower_for_hopper(_mosaic_fn(**options), *args)
    # The prefill kernel, and the decode kernel for the sequences of one token.
    config = options.get("config", mosaic.MosaicPrefillConfig())
    short = config.short_sequences and options.get("short_sequences", True)
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == 1 + short


def test_cross_lowers_poisoned():
    """Poisoned outputs are refs aliased to the kernel's outputs."""
    args = _abstract_args(128, 32, 8, 64, jnp.bfloat16)
    with poison_outputs():
        text = lower_for_hopper(_mosaic_fn(), *args)
    assert "mosaic_gpu" in text


def test_float32_is_a_type_error():
    args = [jnp.ones(a.shape, a.dtype) for a in _abstract_args(64, 4, 4, 16, jnp.float32)]
    with pytest.raises(TypeError, match="q.dtype=float32"):
        mosaic.ragged_paged_attention(*args, sm_scale=0.125)


@pytest.mark.parametrize(
    "head_dim,page_size,config,match",
    [
        (96, 16, None, "multiple of 64"),
        (512, 16, None, "multiple of 64 up to 256"),
        (64, 12, None, "page_size"),
        (64, 256, None, "page_size"),
        (256, 16, mosaic.MosaicPrefillConfig(block_kv=128, num_stages=2), "shared memory"),
    ],
)
def test_unsupported_shapes_are_value_errors(head_dim, page_size, config, match):
    args = _abstract_args(head_dim, 4, 4, page_size, jnp.bfloat16, tokens=16)
    args = [jnp.ones(a.shape, a.dtype) for a in args]
    with pytest.raises(ValueError, match=match):
        mosaic.ragged_paged_attention(*args, sm_scale=0.125, config=config)


def test_interpret_is_refused():
    args = [jnp.ones(a.shape, a.dtype) for a in _abstract_args(64, 4, 4, 16, jnp.bfloat16)]
    with pytest.raises(NotImplementedError, match="no interpret mode"):
        mosaic.ragged_paged_attention(*args, sm_scale=0.125, interpret=True)


@pytest.mark.parametrize("options", [dict(block_kv=96), dict(block_kv=512), dict(num_stages=0)])
def test_config_is_validated(options):
    with pytest.raises(ValueError):
        mosaic.MosaicPrefillConfig(**options)


@pytest.mark.parametrize("head_dim,block_kv", [(64, 128), (128, 128), (256, 64)])
def test_default_config(head_dim, block_kv):
    assert mosaic.MosaicPrefillConfig.default(head_dim) == mosaic.MosaicPrefillConfig(block_kv, 2)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(causal=False), dict(sliding_window=5, logits_soft_cap=2.5)],
    ids=lambda o: "-".join(o) or "plain",
)
def test_decode_tokens_go_to_the_decode_kernel(monkeypatch, options):
    """The rows of one-token sequences come from the decode kernel (here the XLA decode
    reference stands in for it), causal or not, and no other row is touched."""
    rng = np.random.default_rng(len(options))
    seqs = [(1, 37), (5, 21), (1, 1), (0, 9), (1, 100), (3, 17), (1, 16), (0, 0)]
    batch = make_batch(rng, seqs, num_q_heads=8, num_kv_heads=2)
    monkeypatch.setattr(
        mosaic.paged_decode,
        "paged_decode_attention",
        lambda *args, num_splits, **kw: paged_decode_attention_reference(*args, **kw),
    )
    meta = sanitize_metadata(
        batch.kv_lens,
        batch.page_indices,
        batch.cu_q_lens,
        batch.num_seqs,
        num_tokens=batch.q.shape[0],
        num_pages=batch.k_pages.shape[0],
        page_size=batch.k_pages.shape[1],
    )
    nan = jnp.full(batch.q.shape, jnp.nan), jnp.full(batch.q.shape[:2], jnp.nan)
    kernel_options = dict(sliding_window=None, logits_soft_cap=None)
    kernel_options.update((k, v) for k, v in options.items() if k != "causal")
    out, lse = mosaic._attend_decode_tokens(
        batch.q, batch.k_pages, batch.v_pages, meta, *nan, sm_scale=0.125, **kernel_options
    )
    ref_out, ref_lse = oracle(batch, sm_scale=0.125, **options)
    cu = np.asarray(batch.cu_q_lens)[: len(seqs) + 1]
    rows = cu[:-1][np.diff(cu) == 1]
    assert len(rows) == 4
    assert_close(out[rows], lse[rows], ref_out[rows], ref_lse[rows], jnp.float32)
    others = np.setdiff1d(np.arange(batch.q.shape[0]), rows)
    assert np.isnan(np.asarray(out)[others]).all() and np.isnan(np.asarray(lse)[others]).all()


# ---------------------------------------------------------------------------- on the H200


def _run(batch, **options):
    with poison_outputs():
        return jaxpaged.ragged_paged_attention(
            *batch.args(), return_lse=True, implementation="mosaic", **options
        )


# Decode tokens, chunks on prefixes at every alignment to pages and to 8-token rows, whole
# prompts of more than one block, an empty chunk, an empty sequence.
MIXED = [(1, 37), (5, 21), (16, 16), (0, 9), (0, 0), (7, 40), (3, 17), (130, 300), (20, 52)]
MIXED += [(200, 200), (9, 1000), (129, 129), (61, 190)]


# Every shape in bf16; float16 (the same code with another element type) at D=128.
GPU_SHAPES = [pytest.param(s, jnp.bfloat16, id=_shape_id(s) + "-bf16") for s in SHAPES] + [
    pytest.param(s, jnp.float16, id=_shape_id(s) + "-f16") for s in SHAPES if s[0] == 128
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", GPU_SHAPES)
def test_gpu_shapes(shape, dtype):
    head_dim, (num_q_heads, num_kv_heads), page_size = shape
    rng = np.random.default_rng(head_dim + page_size + num_q_heads)
    batch = make_batch(
        rng,
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
    )
    out, lse = _run(batch)
    assert_close(out, lse, *oracle(batch), dtype)


FEATURES = [
    dict(sliding_window=1),
    dict(sliding_window=70),
    dict(logits_soft_cap=2.5),
    dict(sm_scale=0.3, sliding_window=19, logits_soft_cap=7.0),
    dict(causal=False),
    dict(causal=False, sliding_window=100),
    dict(config=mosaic.MosaicPrefillConfig(short_sequences=False)),
    dict(config=mosaic.MosaicPrefillConfig(block_kv=64, num_stages=3)),
    dict(config=mosaic.MosaicPrefillConfig(block_kv=128, num_stages=1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_gpu_features(features, page_size):
    """Windows, soft cap, scale, non-causal and configs, with NaN in every unused page and
    page slot and garbage past each sequence's table row."""
    rng = np.random.default_rng(page_size)
    batch = make_batch(
        rng,
        MIXED,
        num_q_heads=16,
        num_kv_heads=4,
        head_dim=128,
        page_size=page_size,
        dtype=jnp.bfloat16,
    )
    out, lse = _run(batch, **features)
    options = {k: v for k, v in features.items() if k in _ORACLE_OPTIONS}
    assert_close(out, lse, *oracle(batch, **options), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_served_step(head_dim):
    """Prompts, chunks on long prefixes, decode tokens and padding in one call."""
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
        dtype=jnp.bfloat16,
        pad_tokens=37,
        pad_seqs=3,
    )
    _check_against_reference(batch, jnp.bfloat16, implementation="mosaic")
    _check_against_reference(
        batch, jnp.bfloat16, implementation="mosaic", sliding_window=700, logits_soft_cap=30.0
    )


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
    _check_against_reference(batch, jnp.bfloat16, implementation="mosaic")
