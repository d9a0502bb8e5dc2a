"""The attention layer's work between its QKV projection and attention, as one Pallas kernel
(Triton lowering): qk-norm, RoPE, and the K/V append to the pages.

XLA compiles the same arithmetic (`jaxpaged.layers.rope_append`'s reference) into six to
seven small kernels per layer: the q and k norm reductions, the rotation, converts and two
scatters. At batch 1 each costs what any kernel costs in a CUDA graph (~1.3 us), and without
command buffers each launch costs the host ~10 us (benchmarks/NOTES.md, "Session 12"). One
program per (token, KV head) reads that head's G query rows, its k row and its v row, and
writes the rotated queries and the new K/V slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import poisoned_outputs


def supported(head_dim: int) -> bool:
    """Whether the kernel takes `head_dim`: Triton blocks are powers of two, here [G, D/2]
    (G padded, masked)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def rope_append(
    qkv: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    q_scale: jax.Array | None,
    k_scale: jax.Array | None,
    k_pages: jax.Array,
    v_pages: jax.Array,
    slots: jax.Array,
    *,
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`jaxpaged.layers.rope_append` in one kernel; arguments and results as there (checked
    there). The pages are updated in place (aliased). qkv [S, T, Hkv, G + 2, D] holds float32
    partial sums of the projection, summed here and rounded to the pages' dtype first."""
    partial = qkv.ndim == 5
    if not partial:
        qkv = qkv[None]
    num_tokens, num_kv_heads, group2, head_dim = qkv.shape[1:]
    group = group2 - 2
    num_pages, page_size = k_pages.shape[:2]
    q_shape = jax.ShapeDtypeStruct((num_tokens, num_kv_heads * group, head_dim), k_pages.dtype)
    qk_norm = q_scale is not None
    scales = [q_scale, k_scale] if qk_norm else []
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    inputs = [slots, qkv, cos, sin, *scales, k_pages.reshape(flat), v_pages.reshape(flat)]
    aliases = {len(inputs) - 2: 1, len(inputs) - 1: 2}
    for poisoned in poisoned_outputs([q_shape]) or []:
        inputs.append(poisoned)
        aliases[len(inputs) - 1] = 0
    page_shape = jax.ShapeDtypeStruct(flat, k_pages.dtype)
    q, k_flat, v_flat = pl.pallas_call(
        lambda *refs: _kernel(*refs, group=group, qk_norm=qk_norm, eps=eps, partial=partial),
        grid=(num_tokens, num_kv_heads),
        out_shape=(q_shape, page_shape, page_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_append",
    )(*inputs)
    return q, k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def _kernel(slots_ref, qkv_ref, cos_ref, sin_ref, *refs, group, qk_norm, eps, partial):
    q_ref, k_ref, v_ref = refs[-3:]
    scale_refs = refs[:2] if qk_norm else ()
    token, head = pl.program_id(0), pl.program_id(1)
    head_dim = qkv_ref.shape[4]
    half = head_dim // 2
    dtype = k_ref.dtype
    # All integer indexers (no slices): gathers lower the same in Triton and in interpret mode.
    block = pl.next_power_of_2(group)
    rows = jnp.arange(block, dtype=jnp.int32)[:, None]
    row_ok = rows < group
    lo = jnp.arange(half, dtype=jnp.int32)[None, :]
    hi = lo + half
    # Every load comes before the first store: a load after a store cannot be moved above it
    # (the buffers may alias), so each store between loads would add a memory round trip
    # (~0.5 us) to this latency-bound kernel.
    cos = plgpu.load(cos_ref.at[token, lo])  # [1, D/2]
    sin = plgpu.load(sin_ref.at[token, lo])

    def load(row, cols, mask=None):
        """The projection's [rows, cols] in float32: partial sums summed and rounded to the
        dtype, as the projection's own output is."""
        kw = {} if mask is None else dict(mask=mask, other=0)
        parts = [
            plgpu.load(qkv_ref.at[s, token, head, row, cols], **kw).astype(jnp.float32)
            for s in range(qkv_ref.shape[0])
        ]
        x = functools.reduce(jnp.add, parts)
        return x.astype(dtype).astype(jnp.float32) if partial else x

    def load_scale(scale_ref):
        if scale_ref is None:
            return None
        return (
            plgpu.load(scale_ref.at[lo]).astype(jnp.float32),
            plgpu.load(scale_ref.at[hi]).astype(jnp.float32),
        )

    q_scale, k_scale = scale_refs if qk_norm else (None, None)
    kv_row = jnp.zeros((1, 1), jnp.int32)
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    q = load(rows, lo, row_ok), load(rows, hi, row_ok)
    k = load(kv_row + group, lo), load(kv_row + group, hi)
    v = load(kv_row + group + 1, cols)
    q_s, k_s = load_scale(q_scale), load_scale(k_scale)
    slot = slots_ref[token]

    def norm(x1, x2, scale):
        """RMSNorm over D as flax's `nnx.RMSNorm` computes it: float32 statistics, the row
        times (rsqrt * scale), rounded to the dtype."""
        if scale is None:
            return x1, x2
        mean_sq = (jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / head_dim
        r = lax.rsqrt(mean_sq + eps)[:, None]
        return (
            (x1 * (r * scale[0])).astype(dtype).astype(jnp.float32),
            (x2 * (r * scale[1])).astype(dtype).astype(jnp.float32),
        )

    def rotate(x1, x2):
        return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)

    q1, q2 = rotate(*norm(*q, q_s))
    q_rows = head * group + rows
    plgpu.store(q_ref.at[token, q_rows, lo], q1, mask=row_ok)
    plgpu.store(q_ref.at[token, q_rows, hi], q2, mask=row_ok)

    # The new K/V slot: -1, or any slot outside the pool, writes nothing.
    num_slots = k_ref.shape[0]
    ok = (slot >= 0) & (slot < num_slots)
    slot = jnp.clip(slot, 0, num_slots - 1)
    k1, k2 = rotate(*norm(*k, k_s))
    mask = jnp.full((1, half), ok)
    plgpu.store(k_ref.at[slot, head, lo], k1, mask=mask)
    plgpu.store(k_ref.at[slot, head, hi], k2, mask=mask)
    plgpu.store(v_ref.at[slot, head, cols], v.astype(dtype), mask=jnp.full((1, head_dim), ok))
