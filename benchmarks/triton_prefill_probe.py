"""Where the Triton prefill kernel loses to JAX's dense Pallas-Triton `mha` (issue 3): one run
that times the kernel with one thing changed at a time against `mha` and cuDNN paged prefill.

    PYTHONPATH=$PWD python3 -m benchmarks.triton_prefill_probe --out benchmarks/results/x.json

B=1 T=8192 causal bf16 Hq=32 D=128 unless a row says otherwise. Rows: cuDNN paged (anchor);
`mha` on dense K/V with Hq heads (the issue's 405 TFLOP/s reference), at its default 2 stages
and at 3; our kernel at its default (Hkv=8, page 64), with other stage counts, with the grid's
KV head fastest, with every tile masked in one loop, with one page per sequence (contiguous
K/V), with Hkv=32 (one query head per KV head, `mha`'s tile), and both at once; non-causal
`mha` against non-causal ours; and the kernel breakdown of the default call.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import kernel_breakdown_ms, write_results
from jaxpaged import quiet_triton_deprecation, ragged_paged_attention
from pallas_kernels.triton.ragged_prefill import PrefillConfig

T, HQ, D = 8192, 32, 128
DTYPE = jnp.bfloat16
SCALE = D**-0.5


def flops(causal: bool) -> float:
    pairs = T * (T + 1) // 2 if causal else T * T
    return 4.0 * D * HQ * pairs


def paged_inputs(num_kv_heads: int, page_size: int, seed: int = 0):
    pages = T // page_size
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (pages, page_size, num_kv_heads, D)
    table = np.random.default_rng(seed).permutation(pages).reshape(1, pages)
    return (
        jax.random.normal(keys[0], (T, HQ, D), DTYPE),
        jax.random.normal(keys[1], shape, DTYPE),
        jax.random.normal(keys[2], shape, DTYPE),
        jnp.asarray([T], jnp.int32),
        jnp.asarray(table, jnp.int32),
        jnp.asarray([0, T], jnp.int32),
        jnp.asarray(1, jnp.int32),
    )


def ours(config: PrefillConfig, causal: bool = True):
    def fn(q, k, v, kv_lens, table, cu, n):
        return ragged_paged_attention(
            q, k, v, kv_lens, table, cu, n, causal=causal, implementation="triton", config=config
        )

    return fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/triton_prefill_probe.json")
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    quiet_triton_deprecation()
    runner = common.Runner(1e9, args.iterations, rate_key="tflops", unit="TFLOP/s")
    default = PrefillConfig.default(D, DTYPE)
    base = paged_inputs(8, 64)

    from benchmarks.prefill import cudnn_paged_fn

    runner.record("b1-t8192", "cudnn_paged", "anchor", cudnn_paged_fn, *base, work=flops(True))

    from jax.experimental.pallas.ops.gpu import attention as mha_mod

    qd = base[0][None]
    kd = jax.random.normal(jax.random.key(5), (1, T, HQ, D), DTYPE)
    vd = jax.random.normal(jax.random.key(6), (1, T, HQ, D), DTYPE)
    for causal in (True, False):
        for stages in (3,):
            fn = jax.jit(
                lambda q, k, v, c=causal, s=stages: mha_mod.mha(
                    q, k, v, None, sm_scale=SCALE, causal=c, num_stages=s
                )
            )
            runner.record(
                f"b1-t8192{'' if causal else '-noncausal'}",
                "mha_dense",
                f"stages{stages}",
                fn,
                qd,
                kd,
                vd,
                work=flops(causal),
            )

    def variant(name, config, inputs=base, causal=True):
        runner.record(
            f"b1-t8192{'' if causal else '-noncausal'}",
            "ours",
            name,
            ours(config, causal),
            *inputs,
            work=flops(causal),
        )

    variant("default", default)
    fix = dataclasses.replace(default, page_mode="load,fix_out")
    variant("fix_out", fix)
    for stages in (3, 4):
        variant(f"fix_out stages{stages}", dataclasses.replace(fix, num_stages=stages))
    for stages in (3, 4, 5):
        variant(f"fix_out kv64 stages{stages}", dataclasses.replace(fix, block_kv=64, num_stages=stages))
    variant("fix_out carry stages3", dataclasses.replace(fix, carry_page_ids=True, num_stages=3))
    variant("fix_out page16", fix, paged_inputs(8, 16))
    variant("fix_out,static_loop stages3", dataclasses.replace(fix, page_mode="identity,static_loop,fix_out", num_stages=3), paged_inputs(32, T), causal=False)
    variant("fix_out", fix, causal=False)
    breakdown = kernel_breakdown_ms(ours(fix), *base)
    print("breakdown", breakdown, flush=True)
    runner.records.append(dict(case="b1-t8192", impl="ours", variant="breakdown", kernels=breakdown))
    write_results(args.out, "triton_prefill_probe", runner.records)


if __name__ == "__main__":
    main()
