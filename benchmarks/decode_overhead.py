"""Where B=1 decode's fixed costs go (H200 diagnostics for issue 7's B=1 ctx 32k goal).

    PYTHONPATH=$PWD python3 -m benchmarks.decode_overhead --out results/overhead.json

For B=1 ctx 32k (page 16 and 64) it records, each as CUPTI medians: every kernel of the
default Mosaic decode call; the attention kernel alone (partials returned unmerged), called
back to back; the merge kernel alone; cuDNN paged decode. Then the floor of a launch: an
empty Mosaic GPU kernel of 132 programs with a little or most of an SM's shared memory, alone
and each followed by the merge kernel (a shared-memory carve-out change between kernels would
show there). Then wall-clock step times (launch gaps included) of the default and cuDNN.
"""

from __future__ import annotations

import argparse
import json
import time
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import kernel_breakdown_ms, step_time_ms, write_results
from benchmarks.mosaic_decode import cudnn_fn, kv_bytes, make_inputs, mosaic_fn
from pallas_kernels.mosaic import paged_decode as mosaic
from pallas_kernels.triton.merge import merge_partials


def empty_kernel(smem_bytes: int, programs: int = 132):
    """A Mosaic GPU kernel of `programs` programs of two warpgroups that each write one row
    and allocate `smem_bytes` of shared memory besides."""

    def body(o_ref, row_smem, _unused):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
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


def _chain(one):
    def fn(qs, k, v, lens, table):
        return [one(q, k, v, lens, table) for q in qs]

    return fn


def _then_merge(empty):
    def fn(o, l):
        x = empty()
        return merge_partials(o + x[0, 0], l, out_dtype=jnp.bfloat16)

    return fn


def kernels(fn, *args, iterations):
    rows = kernel_breakdown_ms(fn, *args, iterations=iterations)
    return [{"kernel": name[:80], "us": round(ms * 1e3, 3)} for name, ms in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iterations", type=int, default=50)
    args = ap.parse_args()
    it = args.iterations
    records = []

    def add(**record):
        print(json.dumps(record), flush=True)
        records.append(record)
        write_results(args.out, "decode_overhead", records)

    for page_size in (16, 64):
        case = f"b1-ctx32768-ps{page_size}"
        inputs = make_inputs(1, 32768, page_size)
        nbytes = kv_bytes(inputs[3])
        default = jax.jit(mosaic_fn(None, None))
        add(case=case, what="default", kernels=kernels(default, *inputs, iterations=it))
        with mock.patch.object(mosaic, "merge_partials", lambda o, l, out_dtype: (o, l)):
            attention_only = jax.jit(mosaic_fn(None, None))
            partials = jax.block_until_ready(attention_only(*inputs))
        add(
            case=case,
            what="attention kernel alone",
            kernels=kernels(attention_only, *inputs, iterations=it),
        )
        merge = jax.jit(lambda o, l: merge_partials(o, l, out_dtype=jnp.bfloat16))
        add(case=case, what="merge kernel alone", kernels=kernels(merge, *partials, iterations=it))
        cudnn = jax.jit(cudnn_fn())
        add(case=case, what="cudnn paged", kernels=kernels(cudnn, *inputs, iterations=it))
        for name, fn in (("default", default), ("cudnn paged", cudnn)):
            ms = step_time_ms(fn, *inputs, iterations=200)
            add(
                case=case,
                what=f"step time {name}",
                us=round(ms * 1e3, 2),
                tb_s=round(nbytes / ms / 1e9, 3),
            )
        if page_size == 16:
            # Back-to-back throughput: 100 calls dispatched, one wait.
            for name, fn in (("default", default), ("cudnn paged", cudnn)):
                jax.block_until_ready(fn(*inputs))
                t0 = time.perf_counter()
                outs = [fn(*inputs) for _ in range(100)]
                jax.block_until_ready(outs)
                us = (time.perf_counter() - t0) * 1e4
                add(case=case, what=f"100 calls in flight {name}", us_per_call=round(us, 2))
        del inputs, partials

    # Fixed costs of the attention kernel: 16 splits of equal work over shorter contexts
    # (time = fixed + bytes / bandwidth), and a 32k table whose sequence is empty.
    for ctx in (2048, 4096, 8192, 16384, 32768):
        inputs = make_inputs(1, ctx, 16)
        with mock.patch.object(mosaic, "merge_partials", lambda o, l, out_dtype: (o, l)):
            fn = jax.jit(mosaic_fn(None, 16))
            jax.block_until_ready(fn(*inputs))
        add(
            what=f"attention kernel alone, 16 splits, ctx {ctx}",
            mb=round(kv_bytes(inputs[3]) / 1e6, 3),
            kernels=kernels(fn, *inputs, iterations=it),
        )
        if ctx == 32768:
            empty_seq = (*inputs[:3], jnp.zeros_like(inputs[3]), inputs[4])
            add(
                what="attention kernel alone, kv_len 0",
                kernels=kernels(fn, *empty_seq, iterations=it),
            )

    # A chain of calls in one executable: the GPU time per call with every gap between
    # kernels (and any memset) counted, host dispatch amortized.
    inputs = make_inputs(1, 32768, 16)
    qs = [
        jax.random.normal(jax.random.key(10 + i), inputs[0].shape, inputs[0].dtype)
        for i in range(32)
    ]
    for name, one in (("default", mosaic_fn(None, None)), ("cudnn paged", cudnn_fn())):
        chain = jax.jit(_chain(one))
        jax.block_until_ready(chain(qs, *inputs[1:]))
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(chain(qs, *inputs[1:]))
            times.append((time.perf_counter() - t0) * 1e6 / len(qs))
        times.sort()
        add(
            what=f"chain of 32 calls {name}",
            us_per_call=round(times[len(times) // 2], 2),
            tb_s=round(kv_bytes(inputs[3]) / times[len(times) // 2] / 1e6, 3),
        )

    merge_in = (
        jax.random.normal(jax.random.key(1), (1, 16, 32, 128), jnp.float32),
        jax.random.normal(jax.random.key(2), (1, 16, 32), jnp.float32),
    )
    for smem in (1024, 96 * 1024, 200 * 1024):
        empty = jax.jit(empty_kernel(smem))
        add(what=f"empty kernel smem {smem}", kernels=kernels(empty, iterations=it))

        add(
            what=f"empty kernel smem {smem} then merge",
            kernels=kernels(jax.jit(_then_merge(empty)), *merge_in, iterations=it),
        )

    # Sustained loop for the clock log (nvidia-smi runs beside this process).
    inputs = make_inputs(1, 32768, 16)
    default = jax.jit(mosaic_fn(None, None))
    t_end = time.monotonic() + 3.0
    calls = 0
    while time.monotonic() < t_end:
        outs = [default(*inputs) for _ in range(200)]
        jax.block_until_ready(outs)
        calls += 200
    add(what="sustained loop", calls=calls)


if __name__ == "__main__":
    main()
