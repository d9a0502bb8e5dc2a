"""The split-KV merges of the decode kernels against a float64 merge in numpy: the Triton kernel
(pallas_kernels/triton/merge.py, the Triton decode kernel's) in interpret mode on CPU and
compiled on a GPU (`-m gpu`), the Mosaic GPU one (pallas_kernels/mosaic/merge.py, the Mosaic
decode kernel's; cross-lowered on CPU, run on a GPU), and the XLA one
(`pallas_kernels.common.merge_splits`, the Mosaic path's past what its kernel takes) and
`merge_states` (the cascade's merge of a few states) on any device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import merge_splits, merge_states, poison_outputs
from pallas_kernels.mosaic import merge as mosaic_merge
from pallas_kernels.triton.merge import merge_partials
from tests.helpers import lower_for_hopper

# Output tolerance per dtype: the merge itself is float32 (relative error ~1e-6); the output's
# rounding to bfloat16 / float16 is half an ulp (2^-9 / 2^-12 relative) of values up to ~3.
ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 3e-3}
ON_GPU = jax.default_backend() == "gpu"


def _oracle(outs, lses):
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    m = lses.max(axis=1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    w = np.exp(lses - m)  # [X, S, Y]
    denom = w.sum(axis=1)
    weighted = np.where(w[..., None] > 0, w[..., None] * np.nan_to_num(outs), 0.0).sum(axis=1)
    empty = denom == 0
    out = weighted / np.where(empty, 1.0, denom)[..., None]
    lse = np.where(empty, -np.inf, m[:, 0] + np.log(np.where(empty, 1.0, denom)))
    return out, lse


def _partials(num_x, num_splits, num_y, head_dim, seed):
    k_out, k_lse = jax.random.split(jax.random.key(seed))
    outs = jax.random.normal(k_out, (num_x, num_splits, num_y, head_dim), jnp.float32)
    lses = 4.0 * jax.random.normal(k_lse, (num_x, num_splits, num_y), jnp.float32)
    # Empty partials (LSE -inf) hold NaN outputs, which must not reach the result; row (0, 1)
    # is empty in every split.
    lses = lses.at[:, 0, ::2].set(-jnp.inf).at[0, :, 1].set(-jnp.inf)
    outs = jnp.where(jnp.isneginf(lses)[..., None], jnp.nan, outs)
    return outs, lses


MERGES = {
    "triton": lambda outs, lses, dtype: merge_partials(
        outs, lses, out_dtype=dtype, interpret=not ON_GPU
    ),
    "xla": lambda outs, lses, dtype: jax.jit(merge_splits, static_argnames="out_dtype")(
        outs, lses, out_dtype=dtype
    ),
}


def _check(merge, outs, lses, dtype):
    """`merge`: a key of MERGES, or the merge function itself."""
    with poison_outputs():
        out, lse = (MERGES.get(merge) or merge)(outs, lses, dtype)
    want_out, want_lse = _oracle(outs, lses)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, atol=ATOL[dtype], rtol=0)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-6)
    assert (out[np.isneginf(want_lse)] == 0).all()


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_merge(merge, num_splits, dtype):
    outs, lses = _partials(2, num_splits, 6, 64, seed=num_splits)
    _check(merge, outs, lses, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 16, 32, 128), (64, 2, 32, 128), (3, 33, 8, 256), (1, 7, 5, 64)]
)
def test_merge_gpu(merge, shape, dtype):
    outs, lses = _partials(*shape, seed=sum(shape))
    _check(merge, outs, lses, dtype)


def _mosaic(outs, lses, dtype):
    return jax.jit(mosaic_merge.merge_splits, static_argnames="out_dtype")(
        outs, lses, out_dtype=dtype
    )


# (X, splits, Y, D): e2e's B=1 shape (2 slots, 10 splits, 16 heads), odd row counts (one row a
# program), D=256 (two rows), 64 splits (the most loads a thread takes), one split.
MOSAIC_SHAPES = [(2, 10, 16, 128), (3, 7, 5, 64), (1, 3, 6, 256), (2, 64, 4, 128), (4, 1, 8, 128)]


@pytest.mark.parametrize("shape", MOSAIC_SHAPES, ids=str)
def test_mosaic_merge_cross_lowers(shape):
    outs = jax.ShapeDtypeStruct(shape, jnp.float32)
    lses = jax.ShapeDtypeStruct(shape[:3], jnp.float32)
    fn = lambda o, lse: mosaic_merge.merge_splits(o, lse, out_dtype=jnp.bfloat16)  # noqa: E731
    assert "mosaic_gpu" in lower_for_hopper(fn, outs, lses)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize("shape", MOSAIC_SHAPES, ids=str)
def test_mosaic_merge_gpu(shape, dtype):
    outs, lses = _partials(*shape, seed=sum(shape))
    _check(_mosaic, outs, lses, dtype)


@pytest.mark.parametrize(
    "num_rows,head_dim,rows", [(16, 128, 4), (5, 128, 1), (6, 256, 2), (12, 64, 6), (32, 64, 8)]
)
def test_mosaic_merge_rows_per_program(num_rows, head_dim, rows):
    """A program's rows divide the row count and fill at most one vector load per thread."""
    assert mosaic_merge.rows_per_program(num_rows, head_dim) == rows


def test_mosaic_merge_takes_and_refuses():
    assert mosaic_merge.takes(64, 16, 128) and not mosaic_merge.takes(65, 16, 128)
    assert not mosaic_merge.takes(2, 16, 130)  # D not a multiple of the vector width
    outs = jnp.ones((1, 65, 4, 128), jnp.float32)
    with pytest.raises(ValueError, match="at most 64 loads"):
        mosaic_merge.merge_splits(outs, jnp.ones((1, 65, 4)), out_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="lses must be"):
        mosaic_merge.merge_splits(outs[:, :2], jnp.ones((1, 4, 2)), out_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="float32"):
        mosaic_merge.merge_splits(
            outs[:, :2].astype(jnp.bfloat16), jnp.ones((1, 2, 4)), out_dtype=jnp.bfloat16
        )


@pytest.mark.parametrize("shape", [(2, 3, 6, 64), (1, 33, 8, 128)])
def test_merges_agree(shape):
    """The two merges give the same float32 numbers up to rounding (the same arithmetic in
    another order)."""
    outs, lses = _partials(*shape, seed=1)
    (a_out, a_lse), (b_out, b_lse) = (m(outs, lses, jnp.float32) for m in MERGES.values())
    np.testing.assert_allclose(np.asarray(a_out), np.asarray(b_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a_lse), np.asarray(b_lse), rtol=1e-6, atol=1e-6)


def test_lses_shape_is_checked():
    outs = jnp.ones((1, 2, 3, 64), jnp.float32)
    with pytest.raises(ValueError, match="lses must be"):
        merge_partials(outs, jnp.ones((1, 3, 2), jnp.float32), out_dtype=jnp.bfloat16)


@pytest.mark.parametrize("num_states", [1, 3, 5])
def test_merge_states_matches_the_oracle(num_states):
    """Empty states (LSE -inf, output NaN) among them, and rows where every state is empty."""
    keys = jax.random.split(jax.random.key(num_states), 2)
    outs = jax.random.normal(keys[0], (4, num_states, 6, 32))
    lses = 4 * jax.random.normal(keys[1], (4, num_states, 6))
    empty = np.zeros((4, num_states, 6), bool)
    empty[0] = True  # every state of row 0
    empty[1, 0] = True
    empty[2, -1, :3] = True
    lses = jnp.where(empty, -jnp.inf, lses)
    outs = jnp.where(empty[..., None], jnp.nan, outs)
    out, lse = merge_states(
        [outs[:, s] for s in range(num_states)], [lses[:, s] for s in range(num_states)]
    )
    want_out, want_lse = _oracle(outs, lses)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), want_out, atol=ATOL[jnp.float32], rtol=0)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=0)


def test_merge_online_states_is_the_state_of_all_keys():
    """Two online-softmax states over the two halves of the keys merge into the state over all
    of them; a row that saw no visible key on one side, or on both, stays finite (NaN never
    passes)."""
    from pallas_kernels.common import merge_online_states, online_softmax_step

    rng = np.random.default_rng(0)
    logits2 = jnp.asarray(rng.normal(size=(4, 32)) * 3, jnp.float32)
    v = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    logits2 = logits2.at[1, :16].set(-jnp.inf).at[2, 16:].set(-jnp.inf).at[3].set(-jnp.inf)

    def state(lo, hi):
        m0 = jnp.full((4,), -jnp.inf)
        m, l, alpha, p = online_softmax_step(m0, jnp.zeros((4,)), logits2[:, lo:hi])
        return jnp.zeros((4, 8)) * alpha[:, None] + p @ v[lo:hi], m, l

    acc, m, l = merge_online_states(state(0, 16), state(16, 32))
    want_acc, want_m, want_l = state(0, 32)
    assert not np.isnan(np.asarray(acc)).any()
    np.testing.assert_allclose(m, want_m)
    np.testing.assert_allclose(l, want_l, rtol=1e-6)
    np.testing.assert_allclose(acc, want_acc, rtol=1e-5, atol=1e-6)
    assert float(l[3]) == 0.0 and float(m[3]) == -np.inf
