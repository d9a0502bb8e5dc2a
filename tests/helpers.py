"""Random ragged paged batches and the float64 loop that states the semantics independently."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpaged

# Tolerances against the float64 loop, on outputs of magnitude <= ~3 (averages of N(0,1) values):
# - float32: the kernels accumulate in float32 with IEEE dots; error ~1e-6, so 2e-5.
# - bfloat16: the output is rounded to bf16 (half an ulp is 2^-9 relative, 4e-3 near 1-2) and
#   the kernels round softmax probabilities to bf16 before the PV product (another 2^-9
#   relative on each term): 2e-2.
# - float16: ten mantissa bits, the same two roundings at 2^-11: 4e-3.
# LSE is float32 from float32 logits of the (exactly representable) low-precision inputs.
OUT_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
LSE_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-4, jnp.float16: 2e-4}


# The backends of the layer, model and engine tests on the GPU (the `gpu` marker): the compiled
# Triton kernels, and `implementation=None` (the best kernel per op, e.g. Mosaic GPU on Hopper).
GPU_BACKENDS = (("triton", "triton-gpu"), (None, "auto-gpu"))
# Mosaic GPU kernels use wgmma, which has no float32 operands: bf16/f16 only.
DTYPE_LIMITS = {"mosaic": (jnp.bfloat16, jnp.float16)}


def backend_params(cpu=("xla", "triton"), gpu=GPU_BACKENDS) -> list:
    """pytest params of a `backend` argument: `cpu` ones run without a GPU (the kernels in
    Pallas interpret mode), `gpu` (backend, id) pairs under the `gpu` marker. On a GPU a `cpu`
    backend that is also a `gpu` one is skipped: it would run the same compiled kernel."""
    on_gpu = jax.default_backend() == "gpu"
    twice = pytest.mark.skipif(on_gpu, reason="compiled here: runs as its `gpu` param")
    in_gpu = {b for b, _ in gpu}
    return [pytest.param(b, id=b, marks=[twice] if b in in_gpu else []) for b in cpu] + [
        pytest.param(b, id=name, marks=pytest.mark.gpu) for b, name in gpu
    ]


def latin_square(a, b, c) -> list[tuple]:
    """Every pair of values of `a`, `b` and `c` in len(a) * len(b) cases, not the whole product
    (`c`'s value steps along the rows and columns of a Latin square): for the CPU matrices whose
    failures come from one value or a pair (lowering, interpreted kernels), where the GPU runs
    every combination. Needs len(c) <= min(len(a), len(b))."""
    assert len(c) <= min(len(a), len(b)), (len(a), len(b), len(c))
    return [(x, y, c[(i + j) % len(c)]) for i, x in enumerate(a) for j, y in enumerate(b)]


def require(backend: str | None, ops=("ragged", "decode"), dtype=None) -> None:
    """Skip unless `backend` (None: the best one here) runs every op of `ops`, in `dtype`."""
    for op in ops:
        if backend is not None and backend not in jaxpaged.available_implementations(op):
            pytest.skip(f"{backend} is not available for {op} here")
    if dtype is not None and dtype not in DTYPE_LIMITS.get(backend, (dtype,)):
        pytest.skip(f"{backend} takes {DTYPE_LIMITS[backend]} only")


@contextlib.contextmanager
def count_compilations():
    """Yields a list that gets one entry per XLA compilation inside the `with` block: the
    compiled function's name."""
    compiles = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


@dataclasses.dataclass
class Batch:
    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array

    def args(self):
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.kv_lens,
            self.page_indices,
            self.cu_q_lens,
            self.num_seqs,
        )


def make_batch(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype=jnp.float32,
    pad_tokens: int = 3,
    pad_seqs: int = 1,
    spare_pages: int = 3,
    extra_table_pages: int = 1,
) -> Batch:
    """A ragged batch of `(q_len, kv_len)` sequences with pages scattered at random.

    Unused pages hold NaN, unused page-table entries and padding metadata hold garbage, padding
    tokens of q are random: none of it may reach a live output.
    """
    num_live = len(seqs)
    num_slots = num_live + pad_seqs
    pages_needed = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = max(pages_needed + [1]) + extra_table_pages
    num_pages = sum(pages_needed) + spare_pages
    perm = rng.permutation(num_pages)
    table = rng.integers(-(2**20), 2**20, size=(num_slots, pages_per_seq)).astype(np.int32)
    used = np.zeros(num_pages, bool)
    at = 0
    for s, n in enumerate(pages_needed):
        table[s, :n] = perm[at : at + n]
        used[perm[at : at + n]] = True
        at += n
    q_lens = [ql for ql, _ in seqs]
    num_tokens = sum(q_lens) + pad_tokens
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1 : num_live + 1] = np.cumsum(q_lens)
    cu[num_live + 1 :] = rng.integers(-5, 1000, size=pad_seqs)  # garbage after num_seqs
    kv_lens = np.concatenate([[kv for _, kv in seqs], rng.integers(-3, 10**6, size=pad_seqs)])
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[~used] = np.nan
    v[~used] = np.nan
    # Slots of used pages past kv_len hold NaN too.
    for s, (_, kv) in enumerate(seqs):
        for j in range(kv, pages_needed[s] * page_size):
            page = table[s, j // page_size]
            k[page, j % page_size] = np.nan
            v[page, j % page_size] = np.nan
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    return Batch(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        page_indices=jnp.asarray(table),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray(num_live, jnp.int32),
    )


def oracle(batch: Batch, *, sm_scale=None, causal=True, sliding_window=None, logits_soft_cap=None):
    """Attention by a float64 loop over sequences, tokens and heads: (out, lse) as numpy."""
    q = np.asarray(batch.q.astype(jnp.float32), np.float64)
    k = np.asarray(batch.k_pages.astype(jnp.float32), np.float64)
    v = np.asarray(batch.v_pages.astype(jnp.float32), np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    cu = np.asarray(batch.cu_q_lens)
    kv_lens = np.asarray(batch.kv_lens)
    table = np.asarray(batch.page_indices)
    out = np.zeros_like(q)
    lse = np.full((num_tokens, num_q_heads), -np.inf)
    for s in range(int(batch.num_seqs)):
        q_len, kv_len = cu[s + 1] - cu[s], kv_lens[s]
        keys = [table[s, j // page_size] * page_size + j % page_size for j in range(kv_len)]
        ks = k.reshape(-1, num_kv_heads, head_dim)[keys]
        vs = v.reshape(-1, num_kv_heads, head_dim)[keys]
        for i in range(q_len):
            t = cu[s] + i
            p = kv_len - q_len + i
            for h in range(num_q_heads):
                cols = [
                    j
                    for j in range(kv_len)
                    if (not causal or j <= p) and (sliding_window is None or j > p - sliding_window)
                ]
                if not cols:
                    continue
                logits = ks[cols, h // group] @ q[t, h] * scale
                if logits_soft_cap is not None:
                    logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
                m = logits.max()
                w = np.exp(logits - m)
                out[t, h] = w @ vs[cols, h // group] / w.sum()
                lse[t, h] = m + np.log(w.sum())
    return out, lse


def live_tokens(batch: Batch) -> int:
    return int(np.asarray(batch.cu_q_lens)[int(batch.num_seqs)])


def assert_close(out, lse, ref_out, ref_lse, dtype):
    """Compare against the oracle with the dtype's tolerance; NaN anywhere fails."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert not np.isnan(out).any(), "NaN in output"
    np.testing.assert_allclose(out, ref_out, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        assert not np.isnan(lse).any(), "NaN in LSE"
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "empty rows differ"
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(
            lse[finite], ref_lse[finite], atol=LSE_TOL[dtype], rtol=LSE_TOL[dtype]
        )


def lower_for_cuda(fn, *args, compute_capability: int = 90) -> str:
    """Lower `fn(*args)` for CUDA on this (GPU-less) machine and return the StableHLO text.

    This runs the Pallas -> Triton IR lowering of every kernel inside `fn` (not Triton's own
    compiler), so unsupported operations in a kernel body fail here instead of on the H200.
    The lowering asks the device for its compute capability; we pretend to be an sm_90 part.
    """
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    class _Hopper:
        @staticmethod
        def get_gpu_info():
            return gpu_info.GpuInfo(
                gpu_version=None,
                arch_name=f"{compute_capability / 10:.1f}",
                compute_capability=compute_capability,
            )

    saved = pallas_call_registration.gpu_info_lib
    pallas_call_registration.gpu_info_lib = _Hopper
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        pallas_call_registration.gpu_info_lib = saved


def lower_for_hopper(fn, *args) -> str:
    """Lower `fn(*args)` for CUDA on this (GPU-less) machine and return the StableHLO text, as
    the Mosaic GPU kernels need it: Mosaic GPU assumes sm_90 when the default device is not a
    GPU. Unlike `lower_for_cuda` this shows Triton no device, so a Triton kernel inside `fn`
    fails to lower: the Mosaic GPU backend must run none."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
