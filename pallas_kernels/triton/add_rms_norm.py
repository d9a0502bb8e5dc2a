"""A decoder's residual add and the RMSNorm after it, as one Pallas kernel (Triton lowering).

XLA compiles them into three kernels (the add, the norm's reduction, the normalization and
its convert); at batch 1 each costs what any kernel costs in a CUDA graph (~1.3 us), and
without command buffers each launch costs the host ~10 us (benchmarks/NOTES.md, "Session
12"). One program per row.
"""

from __future__ import annotations

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
    there)."""
    num_rows, hidden = x.shape
    out_shape = (jax.ShapeDtypeStruct(x.shape, x.dtype),) * 2
    inputs, aliases = alias_outputs([x, h, scale], poisoned_outputs(out_shape))
    block = pl.next_power_of_2(hidden)
    return pl.pallas_call(
        lambda *refs: _kernel(*refs, eps=eps, block=block),
        grid=(num_rows,),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=min(8, max(1, block // 512)), num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*inputs)


def _kernel(x_ref, h_ref, scale_ref, *refs, eps, block):
    sum_ref, normed_ref = refs[-2:]
    row = pl.program_id(0)
    hidden = x_ref.shape[1]
    # All integer indexers (no slices): gathers lower the same in Triton and in interpret mode.
    cols = jnp.arange(block, dtype=jnp.int32)
    ok = cols < hidden
    # Every load comes before the first store: a load after a store cannot be moved above it
    # (the buffers may alias), so it would wait a memory round trip of its own (~0.5 us).
    x = plgpu.load(x_ref.at[row, cols], mask=ok, other=0).astype(jnp.float32)
    h = plgpu.load(h_ref.at[row, cols], mask=ok, other=0).astype(jnp.float32)
    s = plgpu.load(scale_ref.at[cols], mask=ok, other=0).astype(jnp.float32)
    total = (x + h).astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[row, cols], total, mask=ok)
    # RMSNorm as flax's `nnx.RMSNorm` computes it: float32 statistics of the rounded sum, the
    # row times (rsqrt * scale), rounded to the dtype.
    t = total.astype(jnp.float32)
    r = lax.rsqrt(jnp.sum(t * t) / hidden + eps)
    plgpu.store(normed_ref.at[row, cols], (t * (r * s)).astype(normed_ref.dtype), mask=ok)
