"""The split-KV merge of the decode kernels as one Pallas kernel (Triton lowering).

XLA compiles the same merge (`pallas_kernels.common.merge_splits`) into three to five small
kernels, whose launches are a visible part of a B=1 long-context decode (benchmarks/NOTES.md).
This kernel does the arithmetic in one launch: one program per output row (a query head of a
sequence) reads that row's partial outputs and LSEs of every split. The two loads are
independent: an output load masked by the LSEs would wait for them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import alias_outputs, poisoned_outputs


def merge_partials(
    outs: jax.Array,
    lses: jax.Array,
    *,
    out_dtype,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Merge split-KV partial states, as `pallas_kernels.common.merge_partial_states`.

    Args:
      outs: f32[X, splits, Y, D] normalized partial outputs.
      lses: f32[X, splits, Y] their natural-log LSEs; -inf marks an empty partial (its output
        row is ignored, even if NaN).
      out_dtype: dtype of the merged output.
      interpret: run in Pallas interpret mode (CPU).

    Returns:
      `out` [X, Y, D] in `out_dtype` and `lse` f32[X, Y]; rows whose partials are all empty
      give 0 and -inf.
    """
    num_x, num_splits, num_y, head_dim = outs.shape
    if lses.shape != (num_x, num_splits, num_y):
        raise ValueError(f"lses must be {(num_x, num_splits, num_y)} for outs {outs.shape}")
    out_shape = (
        jax.ShapeDtypeStruct((num_x, num_y, head_dim), out_dtype),
        jax.ShapeDtypeStruct((num_x, num_y), jnp.float32),
    )
    inputs, aliases = alias_outputs([outs, lses], poisoned_outputs(out_shape))
    return pl.pallas_call(
        _merge_kernel,
        grid=(num_x, num_y),
        out_shape=out_shape,
        input_output_aliases=aliases,
        # One warp for up to 16 splits of D=128; more splits get more warps.
        compiler_params=plgpu.CompilerParams(
            num_warps=min(8, max(1, pl.next_power_of_2(num_splits) * head_dim // 2048)),
            num_stages=1,
        ),
        interpret=interpret,
        name="merge_split_kv",
    )(*inputs)


def _merge_kernel(outs_ref, lses_ref, *refs):
    out_ref, lse_ref = refs[-2:]
    x, y = pl.program_id(0), pl.program_id(1)
    num_splits, head_dim = outs_ref.shape[1], outs_ref.shape[3]
    # Triton blocks are powers of two: pad the splits, masked.
    split = jnp.arange(pl.next_power_of_2(num_splits), dtype=jnp.int32)
    real = split < num_splits
    dim = jnp.arange(head_dim, dtype=jnp.int32)
    # Both loads at once (one memory latency, not two); an empty partial's row may hold NaN,
    # so it is replaced after the load rather than skipped by it.
    lse = plgpu.load(lses_ref.at[x, split, y], mask=real, other=-jnp.inf)
    outs = plgpu.load(outs_ref.at[x, split[:, None], y, dim[None, :]], mask=real[:, None])
    m = jnp.max(lse)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse - m_safe)  # 0 for empty and padded splits
    outs = jnp.where((w > 0)[:, None], outs, 0.0)
    denom = jnp.sum(w)
    empty = denom == 0.0
    denom_safe = jnp.where(empty, 1.0, denom)
    out = jnp.sum(w[:, None] * outs, axis=0) / denom_safe
    out_ref[x, y, :] = out.astype(out_ref.dtype)
    lse_ref[x, y] = jnp.where(empty, -jnp.inf, m_safe + lax.log(denom_safe))
