"""One test body per property, run for every backend against the float64 loop (tests/helpers)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged
from pallas_kernels.common import poison_outputs
from tests.helpers import (
    DTYPE_LIMITS,
    OUT_TOL,
    assert_close,
    backend_params,
    latin_square,
    make_batch,
    oracle,
    require,
)

ON_GPU = jax.default_backend() == "gpu"
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# A mixed batch: decode tokens, chunks on prefixes at every page alignment, a whole prompt,
# an empty chunk on a prefix, an empty sequence, and a long-ish chunk.
MIXED = [(1, 37), (5, 21), (16, 16), (0, 9), (0, 0), (7, 40), (3, 17), (1, 1), (20, 52)]


# Here the XLA reference and the Triton kernels in interpret mode; on the GPU both kernels.
BACKENDS = backend_params(gpu=(("triton", "triton-gpu"), ("mosaic", "mosaic-gpu")))


def _ragged(backend, batch, **kw):
    with poison_outputs():
        return jaxpaged.ragged_paged_attention(
            *batch.args(), return_lse=True, implementation=backend, **kw
        )


def _decode(backend, batch, **kw):
    with poison_outputs():
        return jaxpaged.paged_decode_attention(
            batch.q,
            batch.k_pages,
            batch.v_pages,
            batch.kv_lens,
            batch.page_indices,
            return_lse=True,
            implementation=backend,
            **kw,
        )


RAGGED_FEATURES = [
    dict(),
    dict(sliding_window=5),
    dict(logits_soft_cap=2.5),
    dict(sm_scale=0.3, sliding_window=19, logits_soft_cap=7.0),
    dict(causal=False),
]


def _interpreted(backend) -> bool:
    """Whether a `BACKENDS` param is a kernel in Pallas interpret mode (seconds a case on CI)."""
    return backend.values[0] != "xla" and not any(m.name == "gpu" for m in backend.marks)


def _feature_cases():
    """(backend, features, dtype) params: every combination, except that interpreted kernels
    take each feature alone in float32 only, and the 16-bit types without features and with
    all of them at once: a feature's mask or scale is the same code in every dtype, and each
    interpreted case costs CI's two cores ~6 s."""
    cases = []
    for backend, features, dtype in itertools.product(BACKENDS, RAGGED_FEATURES, DTYPES):
        if (
            _interpreted(backend)
            and dtype != jnp.float32
            and features not in (RAGGED_FEATURES[0], RAGGED_FEATURES[3])
        ):
            continue
        name = "-".join(features) or "plain"
        cases.append(
            pytest.param(
                *backend.values,
                features,
                dtype,
                id=f"{jnp.dtype(dtype).name}-{name}-{backend.id}",
                marks=backend.marks,
            )
        )
    return cases


@pytest.mark.parametrize(("backend", "features", "dtype"), _feature_cases())
def test_ragged_features(backend, features, dtype):
    require(backend, ("ragged",), dtype)
    rng = np.random.default_rng(1)
    batch = make_batch(rng, MIXED, dtype=dtype, num_q_heads=4, num_kv_heads=2, head_dim=64)
    out, lse = _ragged(backend, batch, **features)
    assert_close(out, lse, *oracle(batch, **features), dtype)


HEADS, HEAD_DIMS, PAGE_SIZES = [(4, 4), (8, 2), (8, 1)], [64, 128, 256], [16, 64]


def _shape_cases():
    """(backend, (Hq, Hkv, D, page_size)) params: on the GPU every shape; in interpret mode
    and for the reference, every pair of (heads, D, page size) values in nine shapes (on CI's
    two cores the whole product took 118 s, session 26)."""
    every = list(itertools.product(HEADS, HEAD_DIMS, PAGE_SIZES))
    pairs = latin_square(HEADS, HEAD_DIMS, PAGE_SIZES)
    cases = []
    for backend in BACKENDS:
        on_device = any(mark.name == "gpu" for mark in backend.marks)
        for (hq, hkv), d, ps in every if on_device else pairs:
            shape = (hq, hkv, d, ps)
            name = "hq{}-hkv{}-d{}-ps{}".format(*shape)
            cases.append(
                pytest.param(*backend.values, shape, id=f"{name}-{backend.id}", marks=backend.marks)
            )
    return cases


@pytest.mark.parametrize(("backend", "shape"), _shape_cases())
def test_ragged_shapes(backend, shape):
    require(backend, ("ragged",), jnp.bfloat16)
    num_q_heads, num_kv_heads, head_dim, page_size = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    seqs = [(1, 70), (9, page_size + 3), (page_size, 2 * page_size), (0, 0), (12, 12)]
    batch = make_batch(
        rng,
        seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=jnp.bfloat16,
    )
    out, lse = _ragged(backend, batch)
    assert_close(out, lse, *oracle(batch), jnp.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_without_the_short_sequence_launch(backend):
    """`short_sequences=False` (a batch of prompt chunks) leaves the sequences of one or a few
    tokens to the main launch: the same attention from one kernel launch instead of two (the
    Mosaic kernel's launches: tests/test_mosaic_prefill.py, `test_cross_lowers`)."""
    require(backend, ("ragged",), jnp.bfloat16)
    rng = np.random.default_rng(7)
    batch = make_batch(rng, MIXED, dtype=jnp.bfloat16, num_q_heads=4, num_kv_heads=2, head_dim=64)
    out, lse = _ragged(backend, batch, short_sequences=False)
    assert_close(out, lse, *oracle(batch), jnp.bfloat16)

    def launches(short_sequences):
        def attend(*args):
            return jaxpaged.ragged_paged_attention(
                *args, implementation=backend, short_sequences=short_sequences
            )

        return str(jax.make_jaxpr(attend)(*batch.args())).count("pallas_call[")

    if backend == "triton":
        assert (launches(True), launches(False)) == (2, 1)


def _prefix_cases():
    """(backend, prefix) params: prefixes ending at every offset of the 16-token pages that
    matters (page start, one past, one short) with and without a whole page before, two
    pages and a bit more; interpreted kernels skip 31 and 33 (offsets 15 and 1 again, at
    ~12 s each on CI)."""
    cases = []
    for backend in BACKENDS:
        for prefix in [0, 1, 15, 16, 17, 31, 33]:
            if _interpreted(backend) and prefix > 17:
                continue
            cases.append(
                pytest.param(
                    *backend.values, prefix, id=f"{prefix}-{backend.id}", marks=backend.marks
                )
            )
    return cases


@pytest.mark.parametrize(("backend", "prefix"), _prefix_cases())
def test_chunk_on_prefix_every_alignment(backend, prefix):
    """A chunk appended to a cached prefix equals the same rows of single-shot prefill."""
    dtype = DTYPE_LIMITS.get(backend, DTYPES)[0]
    require(backend, ("ragged",), dtype)
    rng = np.random.default_rng(prefix)
    chunk = 11
    whole = make_batch(
        rng, [(prefix + chunk, prefix + chunk)], pad_seqs=0, pad_tokens=0, dtype=dtype
    )
    part = jaxpaged.ragged_paged_attention(
        whole.q[prefix:],
        whole.k_pages,
        whole.v_pages,
        whole.kv_lens,
        whole.page_indices,
        jnp.array([0, chunk], jnp.int32),
        1,
        implementation=backend,
    )
    full = jaxpaged.ragged_paged_attention(*whole.args(), implementation=backend)
    # The same rows computed at another offset in the kernel's tiles: float32 differs in the
    # last bits only; 16-bit outputs may round apart by one step.
    tol = 2e-5 if dtype == jnp.float32 else OUT_TOL[dtype]
    np.testing.assert_allclose(
        np.asarray(part.astype(jnp.float32)),
        np.asarray(full[prefix:].astype(jnp.float32)),
        atol=tol,
        rtol=tol,
    )
    assert_close(part, None, oracle(whole)[0][prefix:], None, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("features", RAGGED_FEATURES[:4], ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_decode(backend, page_size, features, dtype):
    require(backend, ("decode",), dtype)
    rng = np.random.default_rng(page_size)
    lens = [0, 1, page_size - 1, page_size, page_size + 1, 5 * page_size + 7, 300]
    batch = make_batch(
        rng,
        [(1, n) for n in lens],
        page_size=page_size,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=dtype,
        pad_tokens=0,
        pad_seqs=0,
    )
    # kv_len 0 is an inactive slot but still has one (ignored) query token.
    out, lse = _decode(backend, batch, **features)
    ref_out, ref_lse = oracle(batch, **features)
    assert_close(out, lse, ref_out, ref_lse, dtype)


def test_decode_equals_ragged_with_one_token_each():
    rng = np.random.default_rng(5)
    batch = make_batch(rng, [(1, n) for n in (3, 40, 17)], pad_tokens=0, pad_seqs=0)
    a = jaxpaged.paged_decode_attention(
        batch.q,
        batch.k_pages,
        batch.v_pages,
        batch.kv_lens,
        batch.page_indices,
        implementation="xla",
    )
    b = jaxpaged.ragged_paged_attention(*batch.args(), implementation="xla")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_merge_attention_states_matches_union():
    """Attention over keys [0, 16) merged with attention over [16, kv_len) equals the whole."""
    rng = np.random.default_rng(7)
    batch = make_batch(rng, [(4, 40), (2, 33)], pad_seqs=0, pad_tokens=0, page_size=16)
    ref_out, ref_lse = oracle(batch, causal=False)

    def attend(kv_lens, page_indices):
        return jaxpaged.ragged_paged_attention(
            batch.q,
            batch.k_pages,
            batch.v_pages,
            kv_lens,
            page_indices,
            batch.cu_q_lens,
            batch.num_seqs,
            causal=False,
            return_lse=True,
            implementation="xla",
        )

    out_a, lse_a = attend(jnp.minimum(batch.kv_lens, 16), batch.page_indices)
    out_b, lse_b = attend(batch.kv_lens - 16, batch.page_indices[:, 1:])
    out, lse = jaxpaged.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert_close(out, lse, ref_out, ref_lse, jnp.float32)
    # An empty state is the identity.
    out_e, lse_e = jaxpaged.merge_attention_states(
        out_a, lse_a, out_b, jnp.full_like(lse_b, -jnp.inf)
    )
    np.testing.assert_allclose(np.asarray(out_e), np.asarray(out_a), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse_e), np.asarray(lse_a), rtol=1e-6)


def test_merge_two_empty_states_is_empty():
    out = jnp.full((2, 3, 8), 5.0)
    lse = jnp.full((2, 3), -jnp.inf)
    m_out, m_lse = jaxpaged.merge_attention_states(out, lse, out, lse)
    np.testing.assert_array_equal(np.asarray(m_out), 0.0)
    assert np.isneginf(np.asarray(m_lse)).all()


def test_merge_attention_states_is_merge_partial_states_and_ignores_empty_nan():
    """The written-out two-state merge equals the general merge of the stacked states, and a
    state of LSE -inf contributes nothing even where its output row is NaN."""
    from pallas_kernels.common import merge_partial_states

    keys = jax.random.split(jax.random.key(3), 4)
    out_a, out_b = (jax.random.normal(k, (5, 4, 16)) for k in keys[:2])
    lse_a, lse_b = (3 * jax.random.normal(k, (5, 4)) for k in keys[2:])
    lse_b = lse_b.at[1].set(-jnp.inf)
    out_b = out_b.at[1].set(jnp.nan)
    out, lse = jaxpaged.merge_attention_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = merge_partial_states(jnp.stack([out_a, out_b]), jnp.stack([lse_a, lse_b]))
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(out_a[1]))
