"""Paged decode on the H200: the Triton split-KV kernel against cuDNN and JAX's Pallas kernel.

    python -m benchmarks.decode --out benchmarks/results/decode_h200.json

bf16, Hq=32, Hkv=8, D=128. Every case first times the kernel with its defaults and the anchors
(cuDNN paged decode, JAX's deprecated Pallas-Triton `paged_attention` at k_splits 1/8/16, the
XLA reference on one case), then, while `--budget-s` lasts, `num_splits` and `DecodeConfig`
variants so that defaults can be picked from one run. Bandwidth is unique KV bytes (K and V of
every live token) over the CUPTI median kernel time of a whole call (split merge included).

Our kernel and JAX's read a page pool of 2 GiB per K and per V with a random page permutation,
so the working set is far beyond L2. cuDNN needs a pool of exactly B * pages_per_seq pages: it
gets the same logical KV permuted inside such a pool, and our kernel is timed on that pool too
("cudnn-pool"). A failing measurement records its error and the run goes on.

`--smoke` runs tiny shapes in interpret mode (any machine) to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import print_table, write_results
from jaxpaged import paged_decode_attention, quiet_triton_deprecation
from pallas_kernels.common import device_num_sms
from pallas_kernels.triton import paged_decode
from pallas_kernels.triton.paged_decode import DecodeConfig

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = jnp.bfloat16
POOL_BYTES = 2 * 2**30  # per K and per V pool


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    ctx: int  # kv_len of every sequence, or the upper bound of U[1, ctx] when ragged
    page_size: int
    ragged: bool = False
    splits: tuple[int, ...] = ()  # num_splits overrides to sweep
    xla: bool = False  # also time the XLA reference


CASES = (
    Case("b64-ctx4k-p16", 64, 4096, 16, splits=(1, 2, 4, 8), xla=True),
    Case("b64-ctx4k-p64", 64, 4096, 64, splits=(1, 2, 4, 8)),
    Case("b8-ctx32k-p64", 8, 32768, 64, splits=(8, 16, 32, 64)),
    Case("b1-ctx32k-p16", 1, 32768, 16, splits=(32, 64, 256)),
    Case("b64-ragged4k-p16", 64, 4096, 16, ragged=True, splits=(1, 2, 6, 8, 16)),
)
SMOKE_CASES = (
    Case("smoke-b4-ctx256-p16", 4, 256, 16, splits=(1, 3), xla=True),
    Case("smoke-b3-ragged256-p64", 3, 256, 64, ragged=True, splits=(2,)),
)
# DecodeConfig variants timed at the default split count (the default config is timed first).
# Triton pipelines the page-id gather one stage ahead of K and V: K and V get a second buffer
# (loads overlapping compute) only from num_stages=5 on; fewer stages rely on occupancy instead.
CONFIGS = tuple(
    DecodeConfig(block_kv=b, num_warps=w, num_stages=s)
    for b, w, s in [
        (32, 4, 3),
        (32, 4, 5),
        (64, 4, 2),
        (64, 4, 5),
        (64, 8, 5),
        (128, 4, 3),
        (128, 8, 3),
    ]
)
JAX_K_SPLITS = (1, 8, 16)


@dataclasses.dataclass
class Inputs:
    q: jax.Array  # [B, Hq, D]
    k: jax.Array  # [P, page_size, Hkv, D], the large pool
    v: jax.Array
    kv_lens: jax.Array  # i32[B]
    table: jax.Array  # i32[B, pages_per_seq] into the large pool
    kv_bytes: int  # unique K and V bytes of the live tokens


@functools.cache
def _pool(page_size: int, pool_bytes: int) -> tuple[jax.Array, jax.Array]:
    slot_bytes = page_size * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize
    shape = (pool_bytes // slot_bytes, page_size, NUM_KV_HEADS, HEAD_DIM)
    kk, kv = jax.random.split(jax.random.key(page_size))
    return jax.random.normal(kk, shape, DTYPE), jax.random.normal(kv, shape, DTYPE)


@functools.cache
def _transposed_pool(page_size: int, pool_bytes: int) -> tuple[jax.Array, jax.Array]:
    """The pool in the [Hkv, P, page_size, D] layout of JAX's Pallas `paged_attention`."""
    k, v = _pool(page_size, pool_bytes)
    return jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3))


def make_inputs(case: Case, pool_bytes: int) -> Inputs:
    rng = np.random.default_rng(0)
    k, v = _pool(case.page_size, pool_bytes)
    pages_per_seq = case.ctx // case.page_size
    if case.batch * pages_per_seq > k.shape[0]:
        raise ValueError(f"{case.name}: the pool has too few pages")
    if case.ragged:
        lens = rng.integers(1, case.ctx + 1, size=case.batch)
    else:
        lens = np.full(case.batch, case.ctx)
    # Every table entry names a distinct page, scattered over the whole pool.
    table = rng.permutation(k.shape[0])[: case.batch * pages_per_seq]
    q = jax.random.normal(jax.random.key(1), (case.batch, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    kv_bytes = int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * jnp.dtype(DTYPE).itemsize
    return Inputs(
        q,
        k,
        v,
        jnp.asarray(lens, jnp.int32),
        jnp.asarray(table.reshape(case.batch, pages_per_seq), jnp.int32),
        kv_bytes,
    )


def cudnn_pool(inputs: Inputs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same logical KV in a pool of exactly B * pages_per_seq pages (cuDNN's requirement),
    at a random permutation: (k, v, table)."""
    num_pages = inputs.table.size
    perm = np.random.default_rng(1).permutation(num_pages)
    source = inputs.table.reshape(-1)[jnp.asarray(np.argsort(perm))]
    table = jnp.asarray(perm.reshape(inputs.table.shape), jnp.int32)
    return inputs.k[source], inputs.v[source], table


def triton_fn(num_splits: int | None, config: DecodeConfig | None, interpret: bool) -> Callable:
    def fn(q, k, v, kv_lens, table):
        return paged_decode.paged_decode_attention(
            q, k, v, kv_lens, table, num_splits=num_splits, config=config, interpret=interpret
        )[0]

    return fn


def cudnn_fn(q, k, v, kv_lens, table):
    from jax._src.cudnn import fused_attention_stablehlo as fa  # private API: may be missing

    table = table[:, None, :, None]
    out = fa.paged_attention(
        q[:, None],
        k,
        v,
        jnp.ones_like(kv_lens),
        kv_lens,
        table,
        table,
        scale=HEAD_DIM**-0.5,
        mask_type=fa.MaskType.PADDING,
    )
    return out[:, 0]


def jax_pallas_fn(k_splits: int, interpret: bool) -> Callable:
    def fn(q, k, v, kv_lens, table):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        return paged_attention(q, k, v, table, kv_lens, k_splits=k_splits, interpret=interpret)

    return fn


def xla_fn(q, k, v, kv_lens, table):
    return paged_decode_attention(q, k, v, kv_lens, table, implementation="xla")


class Runner(common.Runner):
    """Records TB/s of a case's unique KV bytes."""

    def __init__(self, budget_s: float, iterations: int):
        super().__init__(budget_s, iterations, rate_key="tb_s", unit="TB/s")

    def time(
        self, case: Case, inputs: Inputs, impl: str, variant: str, fn: Callable, *args, **info
    ) -> dict:
        return self.record(case.name, impl, variant, fn, *args, work=inputs.kv_bytes, **info)


def run_anchors(runner: Runner, case: Case, inputs: Inputs, interpret: bool, pool_bytes: int):
    args = (inputs.q, inputs.k, inputs.v, inputs.kv_lens, inputs.table)
    default_splits = paged_decode.choose_num_splits(
        case.batch,
        NUM_KV_HEADS,
        case.ctx,
        block_kv=DecodeConfig.default(HEAD_DIM, DTYPE).block_kv,
        num_sms=device_num_sms(),
    )
    config = dataclasses.asdict(DecodeConfig.default(HEAD_DIM, DTYPE))
    runner.time(
        case,
        inputs,
        "triton",
        "default",
        triton_fn(None, None, interpret),
        *args,
        num_splits=default_splits,
        config=config,
    )
    try:
        k_c, v_c, table_c = cudnn_pool(inputs)
        c_args = (inputs.q, k_c, v_c, inputs.kv_lens, table_c)
        runner.time(
            case,
            inputs,
            "triton",
            "default cudnn-pool",
            triton_fn(None, None, interpret),
            *c_args,
            num_splits=default_splits,
            config=config,
        )
        record = runner.time(case, inputs, "cudnn", "paged", cudnn_fn, *c_args)
        if "ms" in record:
            ours = triton_fn(None, None, interpret)(*args)
            record["max_abs_diff_vs_triton"] = float(
                jnp.max(
                    jnp.abs(
                        ours.astype(jnp.float32) - jax.jit(cudnn_fn)(*c_args).astype(jnp.float32)
                    )
                )
            )
        del k_c, v_c
    except Exception as e:  # noqa: BLE001 - e.g. out of memory building the pool
        runner.records.append(
            dict(
                case=case.name,
                impl="cudnn",
                variant="paged",
                error=f"{type(e).__name__}: {str(e)[:300]}",
            )
        )
    k_t, v_t = _transposed_pool(case.page_size, pool_bytes)
    for k_splits in JAX_K_SPLITS:
        runner.time(
            case,
            inputs,
            "jax",
            f"k_splits={k_splits}",
            jax_pallas_fn(k_splits, interpret),
            inputs.q,
            k_t,
            v_t,
            inputs.kv_lens,
            inputs.table,
        )
    if case.xla:
        runner.time(case, inputs, "xla", "reference", xla_fn, *args)


def sweep_variants(case: Case) -> list[tuple[int | None, DecodeConfig | None]]:
    """(num_splits, config) overrides of one case, split counts and configs alternating."""
    splits = [(n, None) for n in case.splits]
    configs = [(None, c) for c in CONFIGS]
    pairs = itertools.zip_longest(splits, configs)
    return [variant for pair in pairs for variant in pair if variant is not None]


def run_sweep(
    runner: Runner,
    case: Case,
    inputs: Inputs,
    interpret: bool,
    num_splits: int | None,
    config: DecodeConfig | None,
):
    args = (inputs.q, inputs.k, inputs.v, inputs.kv_lens, inputs.table)
    if config is None:
        name, info = f"splits={num_splits}", {}
    else:
        name = f"bkv={config.block_kv} w={config.num_warps} st={config.num_stages}"
        info = dict(config=dataclasses.asdict(config))
    runner.time(
        case,
        inputs,
        "triton",
        name,
        triton_fn(num_splits, config, interpret),
        *args,
        num_splits=num_splits,
        **info,
    )


def add_ratios(records: list[dict]) -> None:
    """Speedups against the anchors of the same case (same run): cuDNN and JAX's best."""

    def best(case, impl):
        times = [r["ms"] for r in records if r["case"] == case and r["impl"] == impl and "ms" in r]
        return min(times, default=None)

    for r in records:
        if "ms" not in r or r["impl"] != "triton":
            continue
        for impl, key in (("cudnn", "x_cudnn"), ("jax", "x_jax")):
            anchor = best(r["case"], impl)
            if anchor is not None:
                r[key] = anchor / r["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="seconds after which the sweeps stop (defaults and anchors all run)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="defaults and anchors only")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes in interpret mode: checks the script on any machine",
    )
    a = parser.parse_args()
    cases, pool_bytes, interpret = CASES, POOL_BYTES, False
    if a.smoke:
        cases, pool_bytes, interpret = SMOKE_CASES, 8 * 2**20, True
    runner = Runner(a.budget_s, iterations=3 if a.smoke else 20)
    start = time.monotonic()
    with quiet_triton_deprecation():
        all_inputs = {}
        for case in cases:
            print(f"== {case.name}", flush=True)
            all_inputs[case.name] = make_inputs(case, pool_bytes)
            run_anchors(runner, case, all_inputs[case.name], interpret, pool_bytes)
        # Round robin over the cases, so that a budget cut leaves every case some variants.
        sweeps = (
            []
            if a.no_sweep
            else [
                (case, variant)
                for i in range(max(len(sweep_variants(c)) for c in cases))
                for case in cases
                for variant in sweep_variants(case)[i : i + 1]
            ]
        )
        skipped = 0
        for case, (num_splits, config) in sweeps:
            if runner.over_budget():
                skipped += 1
                continue
            run_sweep(runner, case, all_inputs[case.name], interpret, num_splits, config)
        if skipped:
            print(f"{skipped} sweep variants skipped: --budget-s spent")
    add_ratios(runner.records)
    write_results(a.out, "decode", runner.records)
    print(
        f"\n{len(runner.records)} measurements in {time.monotonic() - start:.0f} s; "
        f"bf16 Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}; written to {a.out}"
    )
    columns = ["case", "impl", "variant", "num_splits", "ms", "tb_s", "x_cudnn", "x_jax", "error"]
    order = {case.name: i for i, case in enumerate(cases)}
    print_table(sorted(runner.records, key=lambda r: order[r["case"]]), columns)


if __name__ == "__main__":
    main()
