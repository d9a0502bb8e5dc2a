"""`jaxpaged.PagedAttention` against dense causal attention computed in float64 numpy."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpaged
from tests.helpers import backend_params, require

PAGE = 16
HIDDEN, HQ, HKV, D = 96, 4, 2, 64
THETA = 10_000.0
EPS = 1e-6
# (cached prefix, new tokens) per sequence: chunks on a prefix at several page alignments,
# a decode token, a whole prompt, a one-token prompt and an empty chunk.
SEQS = [(0, 9), (13, 5), (16, 1), (31, 17), (0, 1), (20, 0)]
# Layer output against float64 (outputs ~1):
# - float32: the projections and the attention accumulate in float32 (relative ~1e-6 per
#   op); 1e-4 leaves margin for the several matmuls in a row.
# - bfloat16: x, the weights, q/k/v, the pages and the attention output are each rounded to
#   bf16 (2^-9 relative each) and errors add over a projection's 96..256 terms: 5e-2.
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 5e-2}


def _f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _rope_reference(x, positions):
    """RoPE as complex rotation: pair (x_i, x_{i+D/2}) is one complex number."""
    half = x.shape[-1] // 2
    freq = THETA ** (-np.arange(half) / half)
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * positions[:, None, None] * freq)
    return np.concatenate([z.real, z.imag], axis=-1)


def _rms(x, scale):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + EPS) * scale


def _dense_reference(layer, x, qk_norm):
    """Causal self-attention of one whole sequence x [L, hidden]: (out [L, hidden], k, v)."""
    length = x.shape[0]
    q, k, v = jaxpaged.split_qkv(layer.qkv_proj.kernel[...], HQ, HKV, D)
    w = dict(q_proj=_f64(q), k_proj=_f64(k), v_proj=_f64(v))
    w["o_proj"] = _f64(layer.o_proj.kernel[...])
    q = (x @ w["q_proj"]).reshape(length, HQ, D)
    k = (x @ w["k_proj"]).reshape(length, HKV, D)
    v = (x @ w["v_proj"]).reshape(length, HKV, D)
    if qk_norm:
        q, k = _rms(q, _f64(layer.q_norm.scale[...])), _rms(k, _f64(layer.k_norm.scale[...]))
    pos = np.arange(length)
    q, k = _rope_reference(q, pos), _rope_reference(k, pos)
    kq = np.repeat(k, HQ // HKV, axis=1)
    vq = np.repeat(v, HQ // HKV, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, kq) / np.sqrt(D)
    logits = np.where(pos[None, :, None] >= pos[None, None, :], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    out = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), vq).reshape(length, HQ * D)
    return out @ w["o_proj"], k, v


def _pack(xs, lens, rng, num_tokens):
    """Pack the rows of each sequence into `num_tokens` rows; padding tokens are random."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pad = rng.standard_normal((num_tokens - cu[-1], HIDDEN))
    return np.concatenate([x for x, n in zip(xs, lens, strict=True) if n] + [pad]), cu


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_chunk_on_prefix_matches_dense_attention(backend, dtype, qk_norm):
    """Prefill the prefixes in one call, then the chunks in a second: the chunk outputs equal
    dense causal attention over the whole sequences, and the pages hold the rotated K and V of
    every position."""
    require(backend)
    rng = np.random.default_rng(0)
    layer = jaxpaged.PagedAttention(
        HIDDEN,
        HQ,
        HKV,
        D,
        rope_theta=THETA,
        qk_norm=qk_norm,
        norm_eps=EPS,
        dtype=dtype,
        precision="highest" if dtype == jnp.float32 else None,  # no TF32 on the GPU
        rngs=nnx.Rngs(1),
    )
    if qk_norm:  # a non-trivial norm scale, so that a missing scale shows
        layer.q_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
        layer.k_norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, D), dtype)
    xs = [
        jnp.asarray(rng.standard_normal((p + n, HIDDEN)), dtype).astype(jnp.float32)
        for p, n in SEQS
    ]
    pages_per_seq = max(-(-(p + n) // PAGE) for p, n in SEQS) + 1
    num_pages = len(SEQS) * pages_per_seq + 2
    table = rng.permutation(num_pages)[: len(SEQS) * pages_per_seq].reshape(len(SEQS), -1)
    table = np.concatenate([table, rng.integers(-5, 10**6, (1, pages_per_seq))])
    table = jnp.asarray(table, jnp.int32)  # scattered pages, then a padding row of garbage
    shape = (num_pages, PAGE, HKV, D)
    k_pages, v_pages = jnp.full(shape, jnp.nan, dtype), jnp.full(shape, jnp.nan, dtype)

    graphdef, state = nnx.split(layer)
    run = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args, implementation=backend))

    def call(lens, kv_lens, x_rows, k_pages, v_pages):
        # Both calls have the same T (so they compile once), with padding tokens.
        x, cu = _pack(x_rows, lens, rng, num_tokens=sum(p for p, _ in SEQS) + 5)
        cu = np.concatenate([cu, [rng.integers(0, 99)]])  # garbage past num_seqs
        kv = np.concatenate([kv_lens, [rng.integers(0, 10**6)]]).astype(np.int32)
        meta = jaxpaged.StepMetadata.build(
            jnp.asarray(kv), table, jnp.asarray(cu, jnp.int32), len(SEQS), num_tokens=x.shape[0]
        )
        return run(state, jnp.asarray(x, dtype), k_pages, v_pages, meta)

    prefixes = [x[:p] for x, (p, _) in zip(xs, SEQS, strict=True)]
    chunks = [x[p:] for x, (p, _) in zip(xs, SEQS, strict=True)]
    prefix = [p for p, _ in SEQS]
    _, k_pages, v_pages = call(prefix, prefix, prefixes, k_pages, v_pages)
    full = [p + n for p, n in SEQS]
    out, k_pages, v_pages = call([n for _, n in SEQS], full, chunks, k_pages, v_pages)

    tol = TOL[dtype]
    offset = 0
    written = np.zeros(shape[:2], bool)
    for s, (p, n) in enumerate(SEQS):
        ref_out, ref_k, ref_v = _dense_reference(layer, _f64(xs[s]), qk_norm)
        np.testing.assert_allclose(_f64(out[offset : offset + n]), ref_out[p:], atol=tol, rtol=tol)
        offset += n
        pages, slots = np.asarray(table[s])[np.arange(p + n) // PAGE], np.arange(p + n) % PAGE
        written[pages, slots] = True
        np.testing.assert_allclose(_f64(k_pages[pages, slots]), ref_k, atol=tol, rtol=tol)
        np.testing.assert_allclose(_f64(v_pages[pages, slots]), ref_v, atol=tol, rtol=tol)
    assert np.isnan(_f64(k_pages)[~written]).all(), "a write landed outside the sequences' slots"


@pytest.mark.parametrize("backend", backend_params())
def test_decode_step_equals_ragged_step(backend):
    """With one token per sequence, `decode=True` (split-KV decode op) gives the ragged op's
    output and the same pages."""
    require(backend)
    rng = np.random.default_rng(2)
    layer = jaxpaged.PagedAttention(HIDDEN, HQ, HKV, D, qk_norm=True, rngs=nnx.Rngs(3))
    kv_lens = np.array([1, 17, 40, 0], np.int32)  # the last slot is inactive
    num_pages, pages_per_seq = 16, 3
    table = jnp.asarray(rng.permutation(num_pages)[:12].reshape(4, pages_per_seq), jnp.int32)
    shape = (num_pages, PAGE, HKV, D)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, HIDDEN)), jnp.float32)
    cu = jnp.asarray([0, 1, 2, 3, 3], jnp.int32)
    results = []
    for decode in (False, True):
        meta = jaxpaged.StepMetadata.build(
            jnp.asarray(kv_lens), table, cu, 3, num_tokens=4, decode=decode
        )
        # The layer donates the pages it is given: hand each call its own copy.
        results.append(layer(x, k_pages.copy(), v_pages.copy(), meta, implementation=backend))
    (ragged, k_r, v_r), (dec, k_d, v_d) = results
    np.testing.assert_allclose(np.asarray(dec[:3]), np.asarray(ragged[:3]), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(k_d), np.asarray(k_r))
    np.testing.assert_array_equal(np.asarray(v_d), np.asarray(v_r))


def _batched_dots(fn, *args) -> int:
    """How many dot_generals of `fn`'s jaxpr (nested ones included) have a batch dimension."""

    def count(jaxpr):
        n = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
                n += bool(lhs_batch)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                n += count(sub)
        return n

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_small_step_split_k_projections_match_unsplit(backend, dtype, monkeypatch):
    """A step of at most `DECODE_SPLIT_K_MAX_TOKENS` tokens computes qkv as split-K partials
    that `rope_append` sums (a batched dot in its jaxpr), and with `partial_sums` its output
    projection as float32 partials [S, T, hidden] (another); their output and pages equal the
    unsplit projections', within the dtype's rounding."""
    require(backend)
    if jax.default_backend() != "gpu" and (backend == "triton") != (dtype == jnp.bfloat16):
        pytest.skip("off the GPU: the reference in float32, the interpreted kernel in bfloat16")
    rng = np.random.default_rng(4)
    layer = jaxpaged.PagedAttention(
        HIDDEN,
        HQ,
        HKV,
        D,
        qk_norm=True,
        dtype=dtype,
        precision="highest" if dtype == jnp.float32 else None,
        rngs=nnx.Rngs(5),
    )
    kv_lens = np.array([3, 17, 40], np.int32)
    num_pages, pages_per_seq = 12, 3
    table = jnp.asarray(rng.permutation(num_pages)[:9].reshape(3, pages_per_seq), jnp.int32)
    shape = (num_pages, PAGE, HKV, D)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    x = jnp.asarray(rng.standard_normal((3, HIDDEN)), dtype)
    meta = jaxpaged.StepMetadata.build(
        jnp.asarray(kv_lens),
        table,
        jnp.asarray([0, 1, 2, 3], jnp.int32),
        3,
        num_tokens=3,
        pool_shape=(num_pages, PAGE),  # the slots: the path through `rope_append`
    )
    graphdef, state = nnx.split(layer)

    def run(partial_sums=False):
        """(batched dots in the step's jaxpr, its results), traced afresh (a new function:
        JAX caches traces by function)."""

        def step(state, x, k_pages, v_pages):
            return nnx.merge(graphdef, state)(
                x, k_pages, v_pages, meta, implementation=backend, partial_sums=partial_sums
            )

        dots = _batched_dots(step, state, x, k_pages, v_pages)
        return dots, jax.jit(step)(state, x, k_pages.copy(), v_pages.copy())

    assert x.shape[0] <= jaxpaged.layers.DECODE_SPLIT_K_MAX_TOKENS
    assert x.shape[0] <= jaxpaged.layers.DECODE_OUTPUT_SPLIT_K_MAX_TOKENS
    partial_dots, (parts, *partial_pages) = run(partial_sums=True)
    split_dots, split = run()
    monkeypatch.setattr(jaxpaged.layers, "DECODE_SPLIT_K_MAX_TOKENS", 0)
    whole_dots, whole = run()
    assert split_dots == whole_dots + 1  # qkv's
    assert partial_dots == split_dots + 1  # o's
    assert parts.dtype == jnp.float32
    assert parts.shape == (jaxpaged.layers.DECODE_OUTPUT_SPLIT_K, *x.shape)
    # float32: sums in another order (~1e-6). bfloat16: q, k and v are rounded from float32 sums
    # in another order, so a value may round to its neighbour (2^-8 relative), and the
    # attention output (~1) inherits that through its weights; the unsplit o is rounded once
    # more (2^-9 relative) where the partials are not.
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}[dtype]
    for a, b in zip([parts.sum(0), *partial_pages], split, strict=True):
        np.testing.assert_allclose(_f64(a), _f64(b), atol=tol, rtol=tol)
    for a, b in zip(split, whole, strict=True):
        assert not np.isnan(_f64(a)).any()
        np.testing.assert_allclose(_f64(a), _f64(b), atol=tol, rtol=tol)


def test_decode_step_under_a_sliding_window_ignores_prefix_groups():
    """Decode metadata with `prefix_groups` (two slots that share their first two pages) under
    a sliding window: each query has its own window, so the layer runs plain decode (the
    shared-prefix op takes no window; `tests/test_shared_prefix.py` runs it in the engine)."""
    rng = np.random.default_rng(4)
    layer = jaxpaged.PagedAttention(HIDDEN, HQ, HKV, D, sliding_window=8, rngs=nnx.Rngs(5))
    kv_lens = jnp.asarray([40, 35, 17, 0], jnp.int32)  # the last slot is inactive
    table = jnp.asarray([[0, 1, 2], [0, 1, 3], [4, 5, -1], [-1, -1, -1]], jnp.int32)
    shape = (6, PAGE, HKV, D)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, HIDDEN)), jnp.float32)
    meta = jaxpaged.StepMetadata.build(
        kv_lens, table, jnp.arange(5, dtype=jnp.int32), 3, num_tokens=4, decode=True
    )
    groups = jaxpaged.find_prefix_groups(
        table, meta.kv_lens, PAGE, max_group_size=2, min_saved_tokens=1
    )
    assert bool(groups.use) and np.asarray(groups.shared_pages)[0] == 2
    results = [
        layer(x, k_pages.copy(), v_pages.copy(), m, implementation="xla")
        for m in (meta, dataclasses.replace(meta, prefix_groups=groups))
    ]
    (plain, k_p, v_p), (shared, k_s, v_s) = results
    np.testing.assert_allclose(np.asarray(shared[:3]), np.asarray(plain[:3]), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(k_s), np.asarray(k_p))
    np.testing.assert_array_equal(np.asarray(v_s), np.asarray(v_p))


def test_step_metadata_positions():
    """Token i of a sequence sits at kv_len - q_len + i; padding rows never move a token."""
    kv_lens = jnp.asarray([5, 20, 1, 7], jnp.int32)
    cu = jnp.asarray([0, 2, 5, 6, 1], jnp.int32)  # the 4th row is padding with garbage
    meta = jaxpaged.StepMetadata.build(kv_lens, jnp.zeros((4, 2), jnp.int32), cu, 3, num_tokens=8)
    np.testing.assert_array_equal(np.asarray(meta.positions), [3, 4, 17, 18, 19, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(meta.kv_lens), [5, 20, 1, 0])
    with pytest.raises(ValueError, match="one token per sequence slot"):
        jaxpaged.StepMetadata.build(
            kv_lens, jnp.zeros((4, 2), jnp.int32), cu, 3, num_tokens=8, decode=True
        )
    with pytest.raises(ValueError, match="decode=True and prompt_only=True"):
        jaxpaged.StepMetadata.build(
            kv_lens,
            jnp.zeros((4, 2), jnp.int32),
            cu,
            3,
            num_tokens=4,
            decode=True,
            prompt_only=True,
        )


def test_layer_runs_under_jit_with_donated_pages():
    layer = jaxpaged.PagedAttention(HIDDEN, HQ, HKV, D, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    shape = (4, PAGE, HKV, D)

    @jax.jit
    def step(state, k_pages, v_pages, x, meta):
        return nnx.merge(graphdef, state)(x, k_pages, v_pages, meta, implementation="xla")

    meta = jaxpaged.StepMetadata.build(
        jnp.asarray([3], jnp.int32),
        jnp.asarray([[2, 0]], jnp.int32),
        jnp.asarray([0, 3], jnp.int32),
        1,
        num_tokens=3,
    )
    x = jnp.ones((3, HIDDEN), jnp.float32)
    out, k_pages, _ = jax.jit(step, donate_argnums=(1, 2))(
        state, jnp.zeros(shape), jnp.zeros(shape), x, meta
    )
    assert out.shape == (3, HIDDEN) and np.isfinite(np.asarray(out)).all()
    assert np.abs(np.asarray(k_pages[2, :3])).sum() > 0 and not np.asarray(k_pages[0]).any()


def test_decode_steps_fold_rope_append_into_the_mosaic_decode_kernel(monkeypatch):
    """Which steps run `rope_append` inside the Mosaic GPU decode kernel
    (`rope_append_decode_attention`), on a pretended H200: a decode step without shared
    prefixes whose attention runs the Mosaic decode kernel in a grid of items (at most one
    (sequence, KV head) pair per SM), D of 64, 128 or 256, qkv as float32 partial sums or
    in the pages' dtype. The fold's arithmetic is checked on the GPU
    (tests/test_mosaic_decode.py)."""
    from jaxpaged import dispatch, layers  # noqa: PLC0415

    hopper = dispatch.Device("gpu", "9.0", 132)
    monkeypatch.setattr(dispatch, "default_device", lambda: hopper)
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr("pallas_kernels.mosaic.paged_decode.device_num_sms", lambda: 132)

    def folds(
        seqs=16, kv_heads=8, head_dim=128, qkv_dtype=jnp.float32, implementation=None, **meta
    ):
        pages = jax.ShapeDtypeStruct((64, PAGE, kv_heads, head_dim), jnp.bfloat16)
        parts = (4,) if qkv_dtype == jnp.float32 else ()
        qkv = jax.ShapeDtypeStruct((*parts, seqs, kv_heads, 4, head_dim), qkv_dtype)
        step = dict(
            decode=True,
            prefix_groups=None,
            kv_lens=np.zeros(seqs),
            page_indices=np.zeros((seqs, 80)),
        )
        step = type("Meta", (), {**step, **meta})
        return layers.folds_rope(qkv, pages, pages, step, implementation)

    assert folds() and folds(implementation="mosaic") and folds(seqs=1, head_dim=64)
    assert folds(qkv_dtype=jnp.bfloat16)  # an unsplit projection in the pages' dtype
    assert not folds(implementation="triton") and not folds(implementation="xla")
    assert not folds(decode=False) and not folds(prefix_groups=object())
    assert not folds(seqs=17)  # 136 pairs: persistent programs
    assert not folds(head_dim=192) and not folds(qkv_dtype=jnp.float16)
    assert not folds(kv_lens=np.zeros(12))  # 16 tokens for 12 sequences
    monkeypatch.setattr(layers.jax, "default_backend", lambda: "cpu")
    assert not folds()
