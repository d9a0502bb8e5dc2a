"""Where B=1 decode's fixed costs go (H200 diagnostics for issue 7's B=1 ctx 32k goal).

    PYTHONPATH=$PWD python3 -m benchmarks.decode_overhead --out results/overhead.json

Every number is a CUPTI median per kernel (bf16, Hq=32, Hkv=8, D=128). For B=1 ctx 32k at page
16 and 64: every kernel of the default Mosaic decode call; the attention kernel alone (partials
returned unmerged); the merge kernel alone, on those partials; cuDNN paged decode. Then the
attention kernel's fixed cost (the 32k page table with kv_len 0: launch, Q copy, output write)
and the floor of any launch (an empty Mosaic GPU kernel of 132 programs, with a little or most
of an SM's shared memory, alone and followed by the merge kernel).
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import kernel_breakdown_ms, write_results
from benchmarks.mosaic_decode import cudnn_fn, make_inputs, mosaic_fn
from pallas_kernels.mosaic import paged_decode as mosaic
from pallas_kernels.triton.merge import merge_partials


def empty_kernel(smem_bytes: int, programs: int = 132):
    """A Mosaic GPU kernel of `programs` programs of two warpgroups that each write one row
    and allocate `smem_bytes` of shared memory besides."""

    def body(o_ref, row_smem, _unused):
        @pl.when(lax.axis_index("wg") == 0)
        def _():
            row_smem[...] = jnp.full((128,), 1.0, jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(row_smem, o_ref.at[lax.axis_index("p")])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((programs, 128), jnp.float32),
        grid=(programs,),
        grid_names=("p",),
        num_threads=2,
        thread_name="wg",
        scratch_types=(
            plgpu.SMEM((128,), jnp.float32),
            plgpu.SMEM((smem_bytes // 2,), jnp.bfloat16),
        ),
    )


def _then_merge(empty):
    def fn(o, l):
        x = empty()
        return merge_partials(o + x[0, 0], l, out_dtype=jnp.bfloat16)

    return fn


def kernels(fn, *args, iterations):
    rows = kernel_breakdown_ms(fn, *args, iterations=iterations)
    return [{"kernel": name[:80], "us": round(ms * 1e3, 3)} for name, ms in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    it = args.iterations
    records = []

    def add(**record):
        print(json.dumps(record), flush=True)
        records.append(record)
        write_results(args.out, "decode_overhead", records)

    for page_size in (16, 64):
        case = f"b1-ctx32768-ps{page_size}"
        inputs = make_inputs(1, 32768, page_size)
        add(
            case=case,
            what="default",
            kernels=kernels(mosaic_fn(None, None), *inputs, iterations=it),
        )
        with mock.patch.object(mosaic, "merge_splits", lambda o, l, out_dtype: (o, l)):
            attention = jax.jit(mosaic_fn(None, None))
            partials = jax.block_until_ready(attention(*inputs))  # traced inside the patch
        add(
            case=case,
            what="attention kernel alone",
            kernels=kernels(attention, *inputs, iterations=it),
        )
        merge = jax.jit(lambda o, l: merge_partials(o, l, out_dtype=jnp.bfloat16))
        add(case=case, what="merge kernel alone", kernels=kernels(merge, *partials, iterations=it))
        add(case=case, what="cudnn paged", kernels=kernels(cudnn_fn(), *inputs, iterations=it))
        if page_size == 16:
            empty_seq = (*inputs[:3], jnp.zeros_like(inputs[3]), inputs[4])
            add(
                case=case,
                what="attention kernel alone, kv_len 0",
                kernels=kernels(attention, *empty_seq, iterations=it),
            )
        del inputs, partials

    merge_in = (
        jax.random.normal(jax.random.key(1), (1, 16, 32, 128), jnp.float32),
        jax.random.normal(jax.random.key(2), (1, 16, 32), jnp.float32),
    )
    for smem in (1024, 96 * 1024, 200 * 1024):
        empty = jax.jit(empty_kernel(smem))
        add(what=f"empty kernel, {smem} B shared memory", kernels=kernels(empty, iterations=it))
        add(
            what=f"empty kernel, {smem} B shared memory, then merge",
            kernels=kernels(jax.jit(_then_merge(empty)), *merge_in, iterations=it),
        )


if __name__ == "__main__":
    main()
