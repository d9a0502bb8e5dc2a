"""A decoder's residual add and the RMSNorm after it, as one Pallas kernel (Triton lowering).

XLA compiles them into three kernels (the add, the norm's reduction, the normalization and
its convert); at batch 1 each costs what any kernel costs in a CUDA graph (~1.3 us), and
without command buffers each launch costs the host ~10 us (benchmarks/NOTES.md, "Session
12"). One program per row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import alias_outputs, poisoned_outputs


def add_rms_norm(
    x: jax.Array, h: jax.Array, scale: jax.Array, *, eps: float, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """`jaxpaged.layers.add_rms_norm` in one kernel; arguments and results as there (checked
    there). h [S, T, hidden] holds float32 partial sums of the layer's output, summed here and
    rounded to x's dtype first."""
    num_rows, hidden = x.shape
    partial = h.ndim == 3
    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2
    parts = h if partial else h[None]
    inputs, aliases = alias_outputs([x, parts, scale], poisoned_outputs(out_shape))
    block = pl.next_power_of_2(hidden)
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, eps=eps, block=block, partial=partial),
        grid=(num_rows,),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(
            num_warps=_num_warps(block, parts.shape[0]), num_stages=1
        ),
        interpret=interpret,
        name="add_rms_norm",
    )(*inputs)


# A program reads its row's partial sums alone (8 float32 rows of 8 KB at hidden 2048), on one
# SM: with the 4 warps of a plain row the two norms of a B=1 layer took 6.5 us against 3.5
# without partials, with 16 warps 4.4; 32 warps were no faster (runs 161-162).
PARTIAL_NUM_WARPS = 16


def _num_warps(block: int, parts: int) -> int:
    return min(8, max(1, block // 512)) if parts == 1 else PARTIAL_NUM_WARPS


def _kernel(x_ref, h_ref, scale_ref, *refs, eps, block, partial):
    sum_ref, normed_ref = refs[-2:]
    row = pl.program_id(0)
    hidden = x_ref.shape[1]
    # All integer indexers (no slices): gathers lower the same in Triton and in interpret mode.
    cols = jnp.arange(block, dtype=jnp.int32)
    ok = cols < hidden
    # Every load comes before the first store: a load after a store cannot be moved above it
    # (the buffers may alias), so it would wait a memory round trip of its own (~0.5 us).
    x = plgpu.load(x_ref.at[row, cols], mask=ok, other=0).astype(jnp.float32)
    parts = [
        plgpu.load(h_ref.at[i, row, cols], mask=ok, other=0).astype(jnp.float32)
        for i in range(h_ref.shape[0])
    ]
    h = functools.reduce(jnp.add, parts)
    if partial:  # the projection's output, rounded as it would be
        h = h.astype(sum_ref.dtype).astype(jnp.float32)
    s = plgpu.load(scale_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
    total = (x + h).astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[row, cols], total, mask=ok)
    # RMSNorm as flax's `nnx.RMSNorm` computes it: float32 statistics of the rounded sum, the
    # row times (rsqrt * scale), rounded to the dtype.
    t = total.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(t * t) / hidden + eps)
    plgpu.store(normed_ref.at[row, cols], (t * (r * s)).astype(normed_ref.dtype), mask=ok)
