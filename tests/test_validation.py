"""Every static check raises before tracing and every dynamic rule of validate_batch fires."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from pallas_kernels.common import poison_outputs, sanitize_metadata
from tests.helpers import assert_close, backend_params, make_batch, oracle, require


@pytest.fixture
def batch():
    return make_batch(np.random.default_rng(0), [(2, 5), (1, 9)], page_size=4, pad_seqs=1)


def _call(b, **over):
    args = dict(
        q=b.q,
        k_pages=b.k_pages,
        v_pages=b.v_pages,
        kv_lens=b.kv_lens,
        page_indices=b.page_indices,
        cu_q_lens=b.cu_q_lens,
        num_seqs=b.num_seqs,
    )
    kw = {k: over.pop(k) for k in list(over) if k not in args}
    args.update(over)
    kw.setdefault("implementation", "xla")
    return jaxpaged.ragged_paged_attention(*args.values(), **kw)


STATIC_CASES = [
    (dict(q=jnp.zeros((3, 4))), ValueError, r"q must have shape \[T, Hq, D\]"),
    (dict(k_pages=jnp.zeros((4, 4, 64))), ValueError, r"k_pages must have shape"),
    (dict(v_pages=jnp.zeros((1, 4, 2, 64))), ValueError, r"v_pages must have the shape"),
    (dict(q=jnp.zeros((5, 4, 64), jnp.int32)), TypeError, r"q must be float32, bfloat16"),
    (
        dict(q=jnp.zeros((5, 4, 64), jnp.bfloat16)),
        TypeError,
        r"k_pages and v_pages must have q's dtype",
    ),
    (dict(q=jnp.zeros((5, 4, 32))), ValueError, r"head dim D of q \(32\) must equal"),
    (dict(q=jnp.zeros((5, 3, 64))), ValueError, r"Hq .* must be a multiple of Hkv"),
    (dict(kv_lens=jnp.zeros((3,), jnp.float32)), TypeError, r"kv_lens must be an int32"),
    (dict(page_indices=jnp.zeros((3,), jnp.int32)), ValueError, r"page_indices must have 2 dim"),
    (
        dict(page_indices=jnp.zeros((2, 4), jnp.int32)),
        ValueError,
        r"page_indices must have one row per sequence",
    ),
    (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), ValueError, r"cu_q_lens must have S\+1 = 4"),
    (
        dict(num_seqs=jnp.zeros((2,), jnp.int32)),
        ValueError,
        r"num_seqs must be a scalar or have shape \[1\]",
    ),
    (dict(num_seqs=jnp.float32(1)), TypeError, r"num_seqs must be an int32"),
    (dict(sliding_window=0), ValueError, r"sliding_window must be None or an int >= 1"),
    (dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap must be None or a float > 0"),
    (dict(sm_scale=float("nan")), ValueError, r"sm_scale must be a finite"),
    (dict(implementation="cuda-magic"), ValueError, r"'cuda-magic' is unknown; available: \("),
]


@pytest.mark.parametrize("over,exc,match", STATIC_CASES)
def test_static_errors(batch, over, exc, match):
    with pytest.raises(exc, match=match):
        _call(batch, **over)


def test_decode_static_errors(batch):
    q = batch.q[:3]
    with pytest.raises(ValueError, match=r"one token per sequence"):
        jaxpaged.paged_decode_attention(
            batch.q, batch.k_pages, batch.v_pages, batch.kv_lens, batch.page_indices
        )
    with pytest.raises(ValueError, match=r"num_splits must be None or an int >= 1"):
        jaxpaged.paged_decode_attention(
            q, batch.k_pages, batch.v_pages, batch.kv_lens, batch.page_indices, num_splits=0
        )


def test_mosaic_unavailable_off_gpu(batch):
    q = batch.q[:3]
    with pytest.raises(ValueError, match=r"'mosaic' is not available on this machine; available"):
        jaxpaged.paged_decode_attention(
            q,
            batch.k_pages,
            batch.v_pages,
            batch.kv_lens,
            batch.page_indices,
            implementation="mosaic",
        )


def _validate(b, **over):
    args = dict(
        q=b.q,
        k_pages=b.k_pages,
        kv_lens=np.asarray(b.kv_lens),
        page_indices=np.asarray(b.page_indices),
        cu_q_lens=np.asarray(b.cu_q_lens),
        num_seqs=np.asarray(b.num_seqs),
    )
    args.update(over)
    jaxpaged.validate_batch(*args.values())


def test_validate_accepts_a_valid_batch(batch):
    _validate(batch)


def test_validate_rules(batch):
    cu = np.asarray(batch.cu_q_lens)
    kv = np.asarray(batch.kv_lens)
    table = np.asarray(batch.page_indices)
    cases = [
        (dict(num_seqs=np.int32(4)), r"num_seqs must lie in \[0, S=3\]"),
        (dict(cu_q_lens=np.r_[1, cu[1:]]), r"cu_q_lens\[0\] must be 0"),
        (dict(cu_q_lens=np.r_[0, 2, 1, cu[3]]), r"non-decreasing"),
        (dict(cu_q_lens=np.r_[0, 2, 99, 99]), r"exceeds the T=6 tokens"),
        (dict(kv_lens=np.r_[1, kv[1:]]), r"sequence 0: q_len 2 > kv_len 1"),
        (dict(kv_lens=np.r_[kv[0], 999, kv[2]]), r"sequence 1: kv_len 999 exceeds"),
        (
            dict(page_indices=np.where(np.arange(table.shape[1]) == 1, 77, table)),
            r"page_indices\[0, 1\] = 77 is outside \[0, P=",
        ),
        (
            dict(
                page_indices=np.stack(
                    [table[0], np.r_[table[1, :2], table[0, 1], table[1, 3:]], table[2]]
                )
            ),
            r"page .* receives new tokens of sequence 1 but is also used by sequence 0",
        ),
    ]
    for over, match in cases:
        with pytest.raises(ValueError, match=match):
            _validate(batch, **over)


@pytest.mark.parametrize(
    "backend", backend_params(gpu=(("triton", "triton-gpu"), ("mosaic", "mosaic-gpu")))
)
def test_bad_metadata_in_jit_stays_in_bounds(backend):
    """Garbage metadata inside jit reads and writes nothing out of bounds (on a GPU a stray
    access faults): every backend gives the float64 oracle's numbers for the metadata as
    `sanitize_metadata` clamps it. Those may be NaN, and that is allowed: here sequence 0's
    page ids are clamped to the pool's last page, which holds NaN, so its token (1 of the 6)
    is NaN. The other rows (sequence 1's, whose tokens the clamped cu_q_lens move) must
    match."""
    require(backend, ("ragged",), jnp.bfloat16)
    b = make_batch(np.random.default_rng(0), [(2, 5), (1, 9)], dtype=jnp.bfloat16, pad_seqs=1)
    # One more page, all NaN, that no sequence owns: where page id 10**6 is clamped to.
    nan_page = jnp.full((1, *b.k_pages.shape[1:]), jnp.nan, b.k_pages.dtype)
    k_pages, v_pages = (jnp.concatenate([x, nan_page]) for x in (b.k_pages, b.v_pages))
    bad = dict(
        kv_lens=jnp.array([10**6, 9, -5], jnp.int32),
        cu_q_lens=jnp.array([4, 1, 99, -3], jnp.int32),
        page_indices=b.page_indices.at[0].set(10**6),
        num_seqs=jnp.int32(7),
    )
    with poison_outputs():
        out, lse = _call(
            b, k_pages=k_pages, v_pages=v_pages, **bad, return_lse=True, implementation=backend
        )
    clamped = sanitize_metadata(
        **bad, num_tokens=b.q.shape[0], num_pages=k_pages.shape[0], page_size=16
    )
    ref_out, ref_lse = oracle(
        dataclasses.replace(
            b,
            k_pages=k_pages,
            v_pages=v_pages,
            kv_lens=clamped.kv_lens,
            page_indices=clamped.page_indices,
            cu_q_lens=clamped.cu_q_lens,
            num_seqs=clamped.num_seqs,
        )
    )
    nan = np.isnan(ref_out).any(axis=(1, 2))
    np.testing.assert_array_equal(nan, [True, False, False, False, False, False])
    valid = ~nan
    assert_close(out[valid], lse[valid], ref_out[valid], ref_lse[valid], jnp.bfloat16)
