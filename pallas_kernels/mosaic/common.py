"""What the Mosaic GPU kernels share: the inputs they take and their checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import poisoned_outputs

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one program may hold on sm_90


def takes(head_dim: int, page_size: int, block_kv: int) -> bool:
    """Shapes the kernels take: D a multiple of 64 up to 256 (128-byte swizzled tiles, wgmma
    N <= 256) and pages of a multiple of 8 rows that divide a pipeline step (`block_kv`)."""
    return (
        head_dim % 64 == 0 and head_dim <= 256 and page_size % 8 == 0 and block_kv % page_size == 0
    )


def default_block_kv(head_dim: int) -> int:
    """The K/V pipeline step of both kernels' default configs: 128 keys, 64 at D=256 (where
    two stages of 128 keys and the staging buffers would not fit in shared memory)."""
    return 128 if head_dim <= 128 else 64


def check_pipeline(block_kv, num_stages) -> None:
    """The K/V pipeline knobs every Mosaic config has: steps of `block_kv` keys (the N of
    Q K^T, a multiple of 64 up to 256) and `num_stages` of them in shared memory."""
    if not (isinstance(block_kv, int) and block_kv % 64 == 0):
        raise ValueError(f"block_kv must be a multiple of 64; got {block_kv!r}")
    if not 64 <= block_kv <= 256:
        raise ValueError(f"block_kv must be in [64, 256] (wgmma N); got {block_kv}")
    if not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages must be an int >= 1; got {num_stages!r}")


def check_inputs(name: str, dtype, head_dim: int, page_size: int, config, interpret: bool):
    """The checks every Mosaic kernel makes before tracing; `name` says which kernel."""
    if interpret:
        raise NotImplementedError(
            f"the Mosaic GPU {name} kernel has no interpret mode: Mosaic GPU's interpreter "
            "(jax 0.11.2) runs no `pl.run_state` accumulators, per-thread `inline_mgpu` code "
            "or semaphores, which these kernels use; use implementation='triton' or 'xla' "
            "off-GPU"
        )
    if jnp.dtype(dtype) not in DTYPES:
        raise TypeError(
            f"implementation='mosaic' needs bfloat16 or float16 q, k_pages and v_pages "
            f"(wgmma operands are 16-bit here); got q.dtype={dtype}"
        )
    if head_dim % 64 or head_dim > 256:
        raise ValueError(
            f"implementation='mosaic' needs a head dim D that is a multiple of 64 up to 256 "
            f"(128-byte swizzled tiles, wgmma N <= 256); got D={head_dim}"
        )
    if not takes(head_dim, page_size, config.block_kv):
        raise ValueError(
            f"implementation='mosaic' needs a page_size that is a multiple of 8 and divides "
            f"config.block_kv={config.block_kv}; got page_size={page_size}"
        )


def check_smem(config, smem: int, head_dim: int) -> None:
    if smem > SMEM_LIMIT:
        raise ValueError(
            f"config {config} needs {smem} bytes of shared memory at D={head_dim}, over "
            f"{SMEM_LIMIT}; lower num_stages or block_kv"
        )


def launch(body, out_types, inputs, **kernel_kwargs):
    """`plgpu.kernel(body, out_type=out_types, **kernel_kwargs)(*inputs)`. Inside
    `poison_outputs()` the outputs start as NaN instead: refs to `poisoned_outputs` are passed
    in (the body sees them where it sees outputs) and read back."""
    poisoned = poisoned_outputs(out_types)
    if poisoned is None:
        return plgpu.kernel(body, out_type=out_types, **kernel_kwargs)(*inputs)
    out_refs = tuple(jax.new_ref(x) for x in poisoned)
    plgpu.kernel(body, out_type=(), **kernel_kwargs)(*inputs, *out_refs)
    return tuple(r[...] for r in out_refs)
