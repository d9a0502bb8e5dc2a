"""The layer ops with Pallas kernels of their own, against float64 numpy oracles: the
reference ("xla") and the kernel (Triton lowering) in interpret mode on CPU and compiled on a
GPU (`-m gpu`). `jaxpaged.rope_append` (qk-norm, RoPE and the K/V append of an attention
layer: pallas_kernels/triton/rope_append.py) and `jaxpaged.add_rms_norm` (a residual add and
the RMSNorm after it: pallas_kernels/triton/add_rms_norm.py); on the GPU also their Mosaic
GPU kernels (pallas_kernels/mosaic/rope_append.py and add_rms_norm.py, cross-lowered here)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers import RopeScaling, add_rms_norm, rope_append, rope_frequencies
from pallas_kernels.common import poison_outputs
from tests.helpers import lower_for_hopper

# q and the new K are RMS-normalized rows (times scales near 1) rotated: values up to ~4. The
# reference and the kernel round twice, after the norm and after the rotation (half an ulp
# each: 2^-9 relative in bfloat16, 2^-12 in float16), of float32 arithmetic (~1e-6).
ATOL = {jnp.float32: 2e-5, jnp.bfloat16: 4e-2, jnp.float16: 5e-3}
ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATIONS = [
    pytest.param("xla", id="xla"),
    pytest.param("triton", id="triton"),
    pytest.param(None, id="auto-gpu", marks=pytest.mark.gpu),
]
# Both ops also have a Mosaic GPU kernel (`implementation="mosaic"`; the reference off-GPU).
LAYER_IMPLEMENTATIONS = [
    *IMPLEMENTATIONS,
    pytest.param("mosaic", id="mosaic-gpu", marks=pytest.mark.gpu),
]
NUM_PAGES, PAGE = 6, 4


def _oracle(qkv, positions, scales, eps, theta, scaling):
    x = np.asarray(qkv, np.float64)
    num_tokens, num_kv_heads, group2, head_dim = x.shape
    group = group2 - 2
    q = x[:, :, :group].reshape(num_tokens, -1, head_dim)
    k, v = x[:, :, group], x[:, :, group + 1]
    if scales is not None:
        q_scale, k_scale = (np.asarray(s, np.float64) for s in scales)
        q = q / np.sqrt((q * q).mean(-1, keepdims=True) + eps) * q_scale
        k = k / np.sqrt((k * k).mean(-1, keepdims=True) + eps) * k_scale
    # The angles are float32 products, as in the model (and Hugging Face's): at positions of
    # ~40k their rounding is ~2e-3 radians, part of the spec rather than an error.
    freq = rope_frequencies(head_dim, theta, scaling)
    angles = (np.asarray(positions, np.float32)[:, None, None] * freq).astype(np.float64)
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate(a):
        a1, a2 = np.split(a, 2, axis=-1)
        return np.concatenate([a1 * cos - a2 * sin, a2 * cos + a1 * sin], axis=-1)

    return rotate(q), rotate(k), v


def _inputs(num_tokens, num_kv_heads, group, head_dim, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), 6)
    qkv = 2 * jax.random.normal(keys[0], (num_tokens, num_kv_heads, group + 2, head_dim))
    positions = jax.random.randint(keys[1], (num_tokens,), 0, 40_000, jnp.int32)
    scales = [1 + 0.3 * jax.random.normal(k, (head_dim,)) for k in keys[2:4]]
    shape = (NUM_PAGES, PAGE, num_kv_heads, head_dim)
    k_pages, v_pages = (jax.random.normal(k, shape) for k in keys[4:6])
    # Distinct slots, then one -1 and one past the pool: those two write nothing.
    rng = np.random.default_rng(seed)
    slots = rng.permutation(NUM_PAGES * PAGE)[: num_tokens - 2].tolist() + [-1, NUM_PAGES * PAGE]
    cast = [a.astype(dtype) for a in (qkv, k_pages, v_pages, *scales)]
    return cast[0], positions, cast[1], cast[2], jnp.asarray(slots, jnp.int32), cast[3:]


@pytest.mark.parametrize("implementation", LAYER_IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "dtype,group,head_dim,qk_norm,scaling",
    [
        (jnp.float32, 2, 128, True, None),
        (jnp.bfloat16, 2, 128, True, None),
        (jnp.bfloat16, 4, 64, False, RopeScaling("llama3", 8.0)),
        (jnp.float16, 1, 256, True, None),
        (jnp.bfloat16, 3, 128, True, RopeScaling("linear", 2.0)),  # G=3: padded rows
    ],
)
def test_rope_append_matches_the_oracle(implementation, dtype, group, head_dim, qk_norm, scaling):
    if implementation == "triton" and ON_GPU:
        pytest.skip("compiled here: runs as auto-gpu")
    num_kv_heads, eps, theta = 2, 1e-6, 1e6
    qkv, positions, k_pages, v_pages, slots, scales = _inputs(
        11, num_kv_heads, group, head_dim, dtype, seed=group * head_dim
    )
    old_k, old_v = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    scales = scales if qk_norm else None
    with poison_outputs():
        q, k_pages, v_pages = jax.jit(
            rope_append,
            static_argnames=("theta", "scaling", "eps", "implementation"),
            donate_argnums=(2, 3),
        )(
            qkv,
            positions,
            k_pages,
            v_pages,
            slots,
            theta=theta,
            scaling=scaling,
            q_scale=None if scales is None else scales[0],
            k_scale=None if scales is None else scales[1],
            eps=eps,
            implementation=implementation,
        )
    want_q, want_k, want_v = _oracle(qkv, positions, scales, eps, theta, scaling)
    assert q.dtype == k_pages.dtype == dtype and q.shape == want_q.shape
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    assert not np.isnan(q).any()
    np.testing.assert_allclose(q, want_q, atol=ATOL[dtype], rtol=0)
    flat = (NUM_PAGES * PAGE, num_kv_heads, head_dim)
    k_rows, v_rows = k_pages.reshape(flat), v_pages.reshape(flat)
    live = np.asarray(slots[:-2])
    np.testing.assert_allclose(k_rows[live], want_k[:-2], atol=ATOL[dtype], rtol=0)
    np.testing.assert_array_equal(v_rows[live], want_v[:-2])  # copied, never rounded
    # Every other slot, including the ones of the two tokens that write nothing, is untouched.
    rest = np.setdiff1d(np.arange(flat[0]), live)
    np.testing.assert_array_equal(k_rows[rest], old_k.reshape(flat)[rest])
    np.testing.assert_array_equal(v_rows[rest], old_v.reshape(flat)[rest])


@pytest.mark.parametrize("implementation", LAYER_IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype,splits", [(jnp.bfloat16, 4), (jnp.float16, 2), (jnp.float32, 3)])
def test_rope_append_sums_partial_products(implementation, dtype, splits):
    """qkv as float32 partial sums [S, T, Hkv, G + 2, D] (a split-K projection's): summed,
    rounded to the pages' dtype, then as the projection's output."""
    if implementation == "triton" and ON_GPU:
        pytest.skip("compiled here: runs as auto-gpu")
    num_kv_heads, group, head_dim, eps, theta = 2, 2, 128, 1e-6, 1e6
    qkv, positions, k_pages, v_pages, slots, scales = _inputs(
        9, num_kv_heads, group, head_dim, dtype, seed=splits
    )
    parts = jax.random.normal(jax.random.key(7), (splits, *qkv.shape), jnp.float32)
    summed = np.asarray(parts, np.float64).sum(0)
    # The projection's output: the float32 sum rounded once to the dtype.
    rounded = np.asarray(jnp.asarray(summed, jnp.float32).astype(dtype), np.float64)
    with poison_outputs():
        q, k_pages, v_pages = jax.jit(
            rope_append, static_argnames=("theta", "eps", "implementation"), donate_argnums=(2, 3)
        )(
            parts,
            positions,
            k_pages,
            v_pages,
            slots,
            theta=theta,
            q_scale=scales[0],
            k_scale=scales[1],
            eps=eps,
            implementation=implementation,
        )
    want_q, want_k, want_v = _oracle(rounded, positions, scales, eps, theta, None)
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    assert not np.isnan(q).any()
    np.testing.assert_allclose(q, want_q, atol=ATOL[dtype], rtol=0)
    flat = (NUM_PAGES * PAGE, num_kv_heads, head_dim)
    live = np.asarray(slots[:-2])
    np.testing.assert_allclose(k_pages.reshape(flat)[live], want_k[:-2], atol=ATOL[dtype], rtol=0)
    # v is the rounded sum. A float32 sum of S terms of |p| < ~5 in another order differs by
    # < 1e-5, and may then round to the neighbouring value of the dtype: one ulp (eps relative).
    np.testing.assert_allclose(
        v_pages.reshape(flat)[live], want_v[:-2], rtol=float(jnp.finfo(dtype).eps), atol=1e-5
    )


@pytest.mark.parametrize(
    "partial,dtype,group,head_dim,qk_norm",
    [
        (True, jnp.bfloat16, 2, 128, True),
        (False, jnp.float16, 1, 256, True),
        (False, jnp.bfloat16, 4, 64, False),  # two rows a warp
        (True, jnp.float32, 3, 128, True),
    ],
)
def test_mosaic_rope_append_lowers_to_one_kernel_writing_the_pages_in_place(
    partial, dtype, group, head_dim, qk_norm
):
    """The Mosaic GPU kernel, cross-lowered for sm_90 here (its arithmetic runs on the GPU
    only: `mosaic-gpu` above): one Mosaic GPU custom call, no Triton one, its outputs q and the
    two page arrays, the pages aliased to the page operands (a donated pool is updated in
    place, not copied)."""
    from pallas_kernels.mosaic import rope_append as mosaic  # noqa: PLC0415

    num_tokens, num_kv_heads = 5, 2
    shape = (num_tokens, num_kv_heads, group + 2, head_dim)
    qkv = jax.ShapeDtypeStruct((4, *shape) if partial else shape, jnp.float32 if partial else dtype)
    angles = jax.ShapeDtypeStruct((num_tokens, head_dim // 2), jnp.float32)
    scale = jax.ShapeDtypeStruct((head_dim,), dtype) if qk_norm else None
    pages = jax.ShapeDtypeStruct((NUM_PAGES, PAGE, num_kv_heads, head_dim), dtype)
    slots = jax.ShapeDtypeStruct((num_tokens,), jnp.int32)

    def fn(qkv, cos, sin, q_scale, k_scale, k_pages, v_pages, slots):
        return mosaic.rope_append(
            qkv, cos, sin, q_scale, k_scale, k_pages, v_pages, slots, eps=1e-6
        )

    text = lower_for_hopper(fn, qkv, angles, angles, scale, scale, pages, pages, slots)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@mosaic_gpu" in calls[0], calls
    aliased = re.findall(r"operand_index = (\d+)", calls[0])
    num_inputs = 4 + 2 * qk_norm
    assert sorted(map(int, aliased)) == [num_inputs, num_inputs + 1], calls[0]


def test_mosaic_rope_append_takes_head_dims_of_64_128_and_256():
    from pallas_kernels.mosaic import rope_append as mosaic  # noqa: PLC0415

    assert [d for d in range(8, 513, 8) if mosaic.supported(d)] == [64, 128, 256]
    pages = jnp.zeros((NUM_PAGES, PAGE, 2, 96), jnp.bfloat16)
    qkv = jnp.ones((3, 2, 4, 96), jnp.bfloat16)
    angles = jnp.ones((3, 48), jnp.float32)
    slots = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="D of 64, 128 or 256"):
        mosaic.rope_append(qkv, angles, angles, None, None, pages, pages, slots, eps=1e-6)


def test_rope_append_rejects_bad_arguments():
    qkv, positions, k_pages, v_pages, slots, (qs, ks) = _inputs(5, 2, 2, 64, jnp.float32, 0)
    call = dict(theta=1e4, implementation="xla")
    with pytest.raises(ValueError, match=r"qkv must be \[T, Hkv, G \+ 2, D\]"):
        rope_append(qkv[:, :1], positions, k_pages, v_pages, slots, **call)
    with pytest.raises(ValueError, match="partial sums qkv .* must be float32"):
        rope_append(qkv[None].astype(jnp.bfloat16), positions, k_pages, v_pages, slots, **call)
    with pytest.raises(ValueError, match="positions and slots must be"):
        rope_append(qkv, positions[:3], k_pages, v_pages, slots, **call)
    with pytest.raises(ValueError, match="q_scale and k_scale go together"):
        rope_append(qkv, positions, k_pages, v_pages, slots, q_scale=qs, **call)
    with pytest.raises(ValueError, match=r"must be \[D=64\]"):
        rope_append(qkv, positions, k_pages, v_pages, slots, q_scale=qs[:8], k_scale=ks, **call)
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        rope_append(qkv, positions, k_pages, v_pages, slots, theta=1e4, implementation="cuda")


@pytest.mark.parametrize("implementation", LAYER_IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "dtype,hidden", [(jnp.float32, 256), (jnp.bfloat16, 2048), (jnp.float16, 896)]
)
def test_add_rms_norm_matches_the_oracle(implementation, dtype, hidden):
    """hidden 896 (Qwen2-0.5B's) is no power of two: the Triton kernel's padded columns, and
    threads of the Mosaic GPU kernel past the row's end."""
    if implementation == "triton" and ON_GPU:
        pytest.skip("compiled here: runs as auto-gpu")
    keys = jax.random.split(jax.random.key(hidden), 3)
    x, h = (3 * jax.random.normal(k, (7, hidden)) for k in keys[:2])
    scale = 1 + 0.3 * jax.random.normal(keys[2], (hidden,))
    x, h, scale = (a.astype(dtype) for a in (x, h, scale))
    with poison_outputs():
        total, normed = jax.jit(add_rms_norm, static_argnames=("eps", "implementation"))(
            x, h, scale, eps=1e-5, implementation=implementation
        )
    # The sum is rounded once to the dtype (half an ulp of values up to ~12); the norm is of
    # that rounded sum, then rounded once more (values up to ~4).
    want_total = np.asarray(x, np.float64) + np.asarray(h, np.float64)
    np.testing.assert_allclose(np.asarray(total, np.float64), want_total, atol=3 * ATOL[dtype])
    t = np.asarray(total, np.float64)
    want = t / np.sqrt((t * t).mean(-1, keepdims=True) + 1e-5) * np.asarray(scale, np.float64)
    got = np.asarray(normed, np.float64)
    assert total.dtype == normed.dtype == dtype and not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("implementation", LAYER_IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "dtype,hidden,splits", [(jnp.bfloat16, 2048, 4), (jnp.float16, 896, 2), (jnp.float32, 256, 8)]
)
def test_add_rms_norm_sums_partial_products(implementation, dtype, hidden, splits):
    """h as float32 partial sums [S, T, hidden] (a split-K projection's): summed, rounded to
    x's dtype, then added as the projection's output would be."""
    if implementation == "triton" and ON_GPU:
        pytest.skip("compiled here: runs as auto-gpu")
    keys = jax.random.split(jax.random.key(splits), 3)
    x = (3 * jax.random.normal(keys[0], (5, hidden))).astype(dtype)
    parts = 2 * jax.random.normal(keys[1], (splits, 5, hidden), jnp.float32)
    scale = (1 + 0.3 * jax.random.normal(keys[2], (hidden,))).astype(dtype)
    with poison_outputs():
        total, normed = jax.jit(add_rms_norm, static_argnames=("eps", "implementation"))(
            x, parts, scale, eps=1e-5, implementation=implementation
        )
    # The projection's output: the float32 sum rounded once to the dtype. A float32 sum of S
    # terms in another order differs by ~1e-6 and may round to the neighbouring value (one
    # ulp of values up to ~12); the residual add then rounds once more (half an ulp).
    summed = np.asarray(parts, np.float64).sum(0)
    rounded = np.asarray(jnp.asarray(summed, jnp.float32).astype(dtype), np.float64)
    want_total = np.asarray(x, np.float64) + rounded
    ulp = 16 * float(jnp.finfo(dtype).eps)
    got_total = np.asarray(total, np.float64)
    assert total.dtype == normed.dtype == dtype and not np.isnan(got_total).any()
    np.testing.assert_allclose(got_total, want_total, atol=1.5 * ulp + 1e-5, rtol=0)
    t = got_total  # the norm is of the rounded sum, itself checked above
    want = t / np.sqrt((t * t).mean(-1, keepdims=True) + 1e-5) * np.asarray(scale, np.float64)
    got = np.asarray(normed, np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize(
    "partial,dtype,hidden", [(True, jnp.bfloat16, 2048), (False, jnp.float16, 896)]
)
def test_mosaic_add_rms_norm_lowers_to_one_kernel(partial, dtype, hidden):
    """The Mosaic GPU kernel, cross-lowered for sm_90 here (its arithmetic runs on the GPU
    only: `mosaic-gpu` above): one Mosaic GPU custom call, no Triton one."""
    from pallas_kernels.mosaic import add_rms_norm as mosaic  # noqa: PLC0415

    x = jax.ShapeDtypeStruct((5, hidden), dtype)
    h = jax.ShapeDtypeStruct((8, 5, hidden), jnp.float32) if partial else x
    scale = jax.ShapeDtypeStruct((hidden,), dtype)
    text = lower_for_hopper(lambda *a: mosaic.add_rms_norm(*a, eps=1e-6), x, h, scale)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@mosaic_gpu" in calls[0], calls


def test_add_rms_norm_picks_its_mosaic_kernel_on_hopper(monkeypatch):
    """ "mosaic" runs the Mosaic GPU kernel on sm90 for hidden sizes of whole 4s; "triton"
    always the Triton one, and None the Triton one on a GPU."""
    from jaxpaged import layers  # noqa: PLC0415
    from pallas_kernels.mosaic import add_rms_norm as mosaic  # noqa: PLC0415

    def kernel(implementation, hidden, hopper):
        monkeypatch.setattr(layers, "_on_hopper", lambda: hopper)
        chosen = layers._add_rms_norm_kernel(implementation, hidden)
        return "mosaic" if chosen is mosaic.add_rms_norm else "triton" if chosen else "xla"

    assert kernel("mosaic", 2048, True) == "mosaic"
    assert kernel("triton", 2048, True) == kernel("triton", 2048, False) == "triton"
    assert kernel("xla", 2048, True) == "xla"
    gpu_kernel = "triton" if ON_GPU else "xla"  # the reference off-GPU
    assert kernel("mosaic", 2050, True) == kernel("mosaic", 2048, False) == gpu_kernel
    assert kernel(None, 2048, True) == kernel(None, 2048, False) == gpu_kernel


def test_add_rms_norm_rejects_bad_arguments():
    x = jnp.ones((3, 64), jnp.float32)
    with pytest.raises(ValueError, match="x and h must be"):
        add_rms_norm(x, x[:, :32], x[0])
    with pytest.raises(ValueError, match="x and h must be"):
        add_rms_norm(x, jnp.ones((2, 3, 32), jnp.float32), x[0])
    with pytest.raises(ValueError, match=r"partial sums h \[S, T, hidden\] must be float32"):
        add_rms_norm(x.astype(jnp.bfloat16), jnp.ones((2, 3, 64), jnp.bfloat16), x[0])
    with pytest.raises(ValueError, match=r"scale must be \[hidden=64\]"):
        add_rms_norm(x, x, x[0, :8])
