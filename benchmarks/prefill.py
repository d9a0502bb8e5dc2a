"""Ragged paged prefill on the H200: the Triton kernel against cuDNN (paged and dense).

    python -m benchmarks.prefill --out benchmarks/results/prefill_h200.json

bf16, Hq=32, Hkv=8, D=128, page 64. In order:
1. causal prompts (q_len == kv_len) B=1 T=8192 and B=4 T=2048: our kernel with its default
   config, cuDNN paged prefill (private JAX API), cuDNN dense `dot_product_attention` and JAX's
   dense Pallas-Triton `mha` (2 and 3 stages);
2. a mixed step, 4 chunks of 512 on 2048-token prefixes plus 60 decode tokens (ctx U[1536,
   2560]), in one call against the sum of its parts run separately (both by this kernel; the
   decode tokens also by the Triton decode kernel), and in one launch (`short_block_q=0`)
   instead of two;
3. `PrefillConfig` variants: long-launch tiles, depths and page-id fetching on B=1 T=8192
   (the strongest few also on B=4 T=2048), short-sequence tiles on the decode tokens, so that
   the defaults can be picked from one run;
4. B=1 causal prompts of 512..16384 tokens against cuDNN paged.
Steps 3 and 4 stop when `--budget-s` is spent. cuDNN's causal masks align top-left, which is
right only where q_len == kv_len: it is timed on those shapes only.

Throughput is attention FLOPs over the CUPTI median kernel time of one whole call (the block
plans' XLA ops and both launches included): 4 * D * Hq per visible (query, key) pair, counted
exactly from the mask. Pages are a random permutation of a pool of exactly the batch's pages
(cuDNN's requirement), shared by all implementations. A failing measurement records its error
and the run goes on. `--smoke` runs tiny shapes in interpret mode (any machine) to check the
script.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import print_table, write_results
from jaxpaged import quiet_triton_deprecation, ragged_paged_attention
from pallas_kernels.mosaic.ragged_prefill import MosaicPrefillConfig
from pallas_kernels.triton.ragged_prefill import PrefillConfig

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 64
DTYPE = jnp.bfloat16
SCALE = HEAD_DIM**-0.5

DEFAULT = PrefillConfig.default(HEAD_DIM, DTYPE)
# Long-launch variants timed on B=1 T=8192 besides the default (128 rows, 128 keys, 8 warps,
# 5 stages, page ids through the pipeliner: K/V two tiles ahead). (block_kv, num_stages,
# carry_page_ids); all 128 rows and 8 warps: the K/V prefetch depth (one to three tiles) with
# page ids through the pipeliner, and run 2's default (64, 3, carried) and best (128, 3,
# carried) as the link to that run. Offline Triton 3.6 builds for sm_90: one program per SM;
# 128-key tiles spill up to 64 bytes, 64-key tiles none.
CONFIGS = tuple(
    dataclasses.replace(DEFAULT, block_kv=k, num_stages=s, carry_page_ids=c)
    for k, s, c in [
        (128, 3, False),  # K/V one tile ahead: the loop of JAX's dense `mha` (2 stages there)
        (64, 3, False),
        (64, 5, False),
        (64, 8, False),  # K/V three tiles ahead
        (128, 3, True),
        (64, 3, True),
    ]
)
# The strongest candidates again on B=4 T=2048 (shorter sequences: more prologue per tile).
CONFIGS_B4 = (CONFIGS[0], CONFIGS[2], CONFIGS[4])
# Short-sequence variants timed on the decode tokens besides the default (16 rows, 64 keys,
# 4 warps, 3 stages, page ids carried). tests/test_triton_prefill.py checks every variant on
# the GPU.
SHORT_CONFIGS = tuple(
    dataclasses.replace(
        DEFAULT,
        short_block_kv=k,
        short_num_stages=s,
        short_carry_page_ids=c,
    )
    for k, s, c in [
        (64, 2, True),
        (64, 5, False),
    ]
)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A ragged batch over a page pool; `seqs` lists (q_len, kv_len)."""

    name: str
    seqs: tuple[tuple[int, int], ...]

    @property
    def visible_pairs(self) -> int:
        # Causal: token i of a sequence sits at kv_len - q_len + i and sees that many keys + 1.
        return sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in self.seqs)

    @property
    def flops(self) -> int:
        return 4 * HEAD_DIM * NUM_Q_HEADS * self.visible_pairs


@dataclasses.dataclass
class Inputs:
    q: jax.Array  # [T, Hq, D]
    k: jax.Array  # [P, page_size, Hkv, D]
    v: jax.Array
    kv_lens: jax.Array  # i32[S]
    table: jax.Array  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array  # i32[S+1]

    def args(self):
        return (
            self.q,
            self.k,
            self.v,
            self.kv_lens,
            self.table,
            self.cu_q_lens,
            jnp.asarray(self.kv_lens.shape[0], jnp.int32),
        )


def make_inputs(batch: Batch, seed: int = 0) -> Inputs:
    q_lens = np.array([q for q, _ in batch.seqs])
    kv_lens = np.array([kv for _, kv in batch.seqs])
    pages_per_seq = int(-(-kv_lens.max() // PAGE_SIZE))
    num_pages = len(batch.seqs) * pages_per_seq
    table = np.random.default_rng(seed).permutation(num_pages).reshape(-1, pages_per_seq)
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return Inputs(
        q=jax.random.normal(keys[0], (int(q_lens.sum()), NUM_Q_HEADS, HEAD_DIM), DTYPE),
        k=jax.random.normal(keys[1], shape, DTYPE),
        v=jax.random.normal(keys[2], shape, DTYPE),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        table=jnp.asarray(table, jnp.int32),
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
    )


def triton_fn(config: PrefillConfig | None, interpret: bool) -> Callable:
    def fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
        return ragged_paged_attention(
            q,
            k,
            v,
            kv_lens,
            table,
            cu_q_lens,
            num_seqs,
            implementation="triton",
            config=config,
            interpret=interpret,
        )

    return fn


def mosaic_fn(config: MosaicPrefillConfig | None = None) -> Callable:
    """The Mosaic GPU prefill kernel (GPU only)."""

    def fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
        return ragged_paged_attention(
            q, k, v, kv_lens, table, cu_q_lens, num_seqs, implementation="mosaic", config=config
        )

    return fn


def _dense_shape(x: jax.Array, batch: int) -> jax.Array:
    return x.reshape(batch, -1, *x.shape[1:])


def cudnn_paged_fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
    """cuDNN paged prefill; every sequence has q_len == kv_len."""
    del cu_q_lens, num_seqs
    from jax._src.cudnn import fused_attention_stablehlo as fa  # private API: may be missing

    num_seqs = kv_lens.shape[0]
    table = table[:, None, :, None]
    out = fa.paged_attention(
        _dense_shape(q, num_seqs),
        k,
        v,
        kv_lens,
        kv_lens,
        table,
        table,
        scale=SCALE,
        mask_type=fa.MaskType.PADDING_CAUSAL,
    )
    return out.reshape(q.shape)


def cudnn_dense_fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
    """cuDNN dense attention on contiguous K/V (gathered outside the timed call)."""
    del table, cu_q_lens, num_seqs
    num_seqs = kv_lens.shape[0]
    out = jax.nn.dot_product_attention(
        _dense_shape(q, num_seqs), k, v, is_causal=True, implementation="cudnn"
    )
    return out.reshape(q.shape)


def mha_dense_fn(num_stages: int, interpret: bool) -> Callable:
    """JAX's dense Pallas-Triton flash attention (`mha`, deprecated with the Triton lowering),
    causal at its default tiles, on contiguous K/V already repeated to Hq heads."""

    def fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
        del table, cu_q_lens, num_seqs
        from jax.experimental.pallas.ops.gpu import attention

        out = attention.mha(
            _dense_shape(q, kv_lens.shape[0]),
            k,
            v,
            None,
            sm_scale=SCALE,
            causal=True,
            num_stages=num_stages,
            interpret=interpret,
        )
        return out.reshape(q.shape)

    return fn


def dense_kv(inputs: Inputs) -> tuple[jax.Array, jax.Array]:
    """K, V [B, L, Hkv, D] in sequence order, for the dense anchor."""

    def gather(pages):
        return pages[inputs.table].reshape(inputs.table.shape[0], -1, NUM_KV_HEADS, HEAD_DIM)

    return gather(inputs.k), gather(inputs.v)


def decode_fn(interpret: bool) -> Callable:
    """The decode tokens by the Triton split-KV decode kernel (q_len 1 per sequence)."""
    from jaxpaged import paged_decode_attention

    def fn(q, k, v, kv_lens, table, cu_q_lens, num_seqs):
        del cu_q_lens, num_seqs
        return paged_decode_attention(
            q, k, v, kv_lens, table, implementation="triton", interpret=interpret
        )

    return fn


class Runner(common.Runner):
    """Records TFLOP/s of a batch's visible (query, key) pairs."""

    def __init__(self, budget_s: float, iterations: int):
        super().__init__(budget_s, iterations, rate_key="tflops", unit="TFLOP/s")

    def time(self, batch: Batch, impl: str, variant: str, fn: Callable, *args, **info) -> dict:
        return self.record(batch.name, impl, variant, fn, *args, work=batch.flops, **info)


def _config_name(config: PrefillConfig) -> str:
    if config == DEFAULT:
        return "default"
    changed = [
        f"{field.name}={getattr(config, field.name)}"
        for field in dataclasses.fields(config)
        if getattr(config, field.name) != getattr(DEFAULT, field.name)
    ]
    return " ".join(changed)


def parse_variant(text: str, default=DEFAULT):
    """`"block_q=64,num_warps=4"` -> `default` (a config) with those fields changed."""
    changes = {}
    for item in text.split(","):
        name, value = item.split("=")
        changes[name] = value == "True" if value in ("True", "False") else int(value)
    return dataclasses.replace(default, **changes)


def _max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def run_prompts(
    runner: Runner, batch: Batch, interpret: bool, *, dense: bool, check: bool = False
) -> None:
    """Our default against cuDNN paged (and dense) on q_len == kv_len prompts; `check` also
    records the largest output difference (it compiles every function once more)."""
    print(f"== {batch.name}: {batch.flops / 1e12:.2f} TFLOP", flush=True)
    inputs = make_inputs(batch)
    args = inputs.args()
    ours = runner.time(batch, "triton", "default", triton_fn(None, interpret), *args)
    if not interpret:
        mosaic = runner.time(batch, "mosaic", "default", mosaic_fn(), *args)
    anchors = [("cudnn-paged", cudnn_paged_fn, args)]
    if dense:
        try:
            k, v = dense_kv(inputs)
            dense_args = (inputs.q, k, v, *args[3:])
            anchors.append(("cudnn-dense", cudnn_dense_fn, dense_args))
            # `mha` has no GQA: K/V repeated to Hq heads outside the timed call. Its default
            # is 2 stages; 3 is its best on the H200 (432 against 402 TFLOP/s at B=1 T=8192,
            # run 20).
            group = NUM_Q_HEADS // NUM_KV_HEADS
            mha_args = (inputs.q, *(jnp.repeat(x, group, axis=2) for x in (k, v)), *args[3:])
            for stages in (2, 3):
                anchors.append(
                    (f"mha-dense-stages{stages}", mha_dense_fn(stages, interpret), mha_args)
                )
        except Exception as e:  # noqa: BLE001 - e.g. out of memory
            runner.records.append(dict(case=batch.name, impl="cudnn-dense", error=repr(e)[:300]))
    for impl, fn, anchor_args in anchors:
        record = runner.time(batch, impl, "causal", fn, *anchor_args)
        for r in [ours] if interpret else [ours, mosaic]:
            if "ms" in record and "ms" in r:
                r[f"vs_{impl}"] = record["ms"] / r["ms"]
        if check and "ms" in record and "ms" in ours:
            try:
                record["max_abs_diff_vs_triton"] = _max_diff(
                    jax.jit(fn)(*anchor_args), jax.jit(triton_fn(None, interpret))(*args)
                )
            except Exception as e:  # noqa: BLE001
                record["max_abs_diff_vs_triton"] = repr(e)[:200]


def mixed_batches(num_chunks=4, chunk=512, prefix=2048, num_decode=60, smoke=False):
    """The mixed step and its two parts, as (mixed, chunks, decodes)."""
    if smoke:
        num_chunks, chunk, prefix, num_decode = 2, 16, 48, 5
    rng = np.random.default_rng(0)
    chunks = tuple((chunk, prefix + chunk) for _ in range(num_chunks))
    ctx = rng.integers(3 * prefix // 4, 5 * prefix // 4 + 1, size=num_decode)
    decodes = tuple((1, int(n)) for n in ctx)
    return (
        Batch("mixed", chunks + decodes),
        Batch("mixed:chunks", chunks),
        Batch("mixed:decodes", decodes),
    )


def run_mixed(runner: Runner, interpret: bool, smoke: bool) -> Batch:
    """The mixed step against its parts; returns the decode tokens' batch."""
    mixed, chunks, decodes = mixed_batches(smoke=smoke)
    print(f"== mixed: {mixed.flops / 1e12:.3f} TFLOP in {len(mixed.seqs)} sequences", flush=True)
    times = {}
    for batch in (mixed, chunks, decodes):
        record = runner.time(
            batch, "triton", "default", triton_fn(None, interpret), *make_inputs(batch).args()
        )
        times[batch.name] = record.get("ms")
    one_launch = dataclasses.replace(DEFAULT, short_block_q=0)
    runner.time(
        mixed,
        "triton",
        _config_name(one_launch),
        triton_fn(one_launch, interpret),
        *make_inputs(mixed).args(),
        config=dataclasses.asdict(one_launch),
    )
    inputs = make_inputs(decodes)
    runner.time(
        decodes,
        "triton-decode",
        "default",
        decode_fn(interpret),
        inputs.q,
        inputs.k,
        inputs.v,
        inputs.kv_lens,
        inputs.table,
        None,
        None,
    )
    if None not in times.values():
        parts = times[chunks.name] + times[decodes.name]
        runner.records.append(
            dict(
                case=mixed.name,
                impl="triton",
                variant="sum of parts",
                ms=parts,
                tflops=mixed.flops / parts / 1e9,
                mixed_over_parts=times[mixed.name] / parts,
            )
        )
    return decodes


def run_configs(runner: Runner, batch: Batch, configs, interpret: bool) -> None:
    print(f"== configs on {batch.name}", flush=True)
    inputs = make_inputs(batch)
    for config in configs:
        name = _config_name(config)
        if runner.over_budget():
            runner.records.append(
                dict(case=batch.name, impl="triton", variant=name, error="budget spent")
            )
            continue
        runner.time(
            batch,
            "triton",
            name,
            triton_fn(config, interpret),
            *inputs.args(),
            config=dataclasses.asdict(config),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="seconds after which the config and length sweeps stop",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes in interpret mode: checks the script on any machine",
    )
    parser.add_argument(
        "--mosaic-variants",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE,...",
        help="with --variants: MosaicPrefillConfig changes to time too",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        metavar="FIELD=VALUE,...",
        help="time only these PrefillConfig changes (e.g. block_q=64,num_warps=4) on B=1 "
        "T=8192 and B=4 T=2048, besides the default and cuDNN paged",
    )
    a = parser.parse_args()
    interpret = a.smoke
    runner = Runner(a.budget_s, iterations=3 if a.smoke else 20)
    scale = 64 if a.smoke else 1  # smoke: T=8192 becomes 128
    start = time.monotonic()
    with quiet_triton_deprecation():
        headline = Batch(f"b1-t{8192 // scale}", ((8192 // scale, 8192 // scale),))
        run_prompts(runner, headline, interpret, dense=True, check=True)
        b4 = Batch(f"b4-t{2048 // scale}", ((2048 // scale, 2048 // scale),) * 4)
        run_prompts(runner, b4, interpret, dense=a.variants is None)
        if a.variants is not None:
            configs = [parse_variant(v) for v in a.variants]
            mosaic_configs = [parse_variant(v, MosaicPrefillConfig()) for v in a.mosaic_variants]
            for batch in (headline, b4):
                run_configs(runner, batch, configs, interpret)
                inputs = make_inputs(batch)
                for config in mosaic_configs:
                    runner.time(batch, "mosaic", str(config), mosaic_fn(config), *inputs.args())
        else:
            decodes = run_mixed(runner, interpret, a.smoke)
            run_configs(runner, headline, CONFIGS[: 2 if a.smoke else None], interpret)
            run_configs(runner, b4, CONFIGS_B4[: 1 if a.smoke else None], interpret)
            run_configs(runner, decodes, SHORT_CONFIGS[: 1 if a.smoke else None], interpret)
            for length in (512, 1024, 2048, 4096, 16384):
                length //= scale
                if runner.over_budget():
                    break
                run_prompts(
                    runner, Batch(f"b1-t{length}", ((length, length),)), interpret, dense=False
                )
    write_results(a.out, "prefill", runner.records)
    print(
        f"\n{len(runner.records)} measurements in {time.monotonic() - start:.0f} s; "
        f"bf16 Hq={NUM_Q_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} page {PAGE_SIZE}; "
        f"written to {a.out}"
    )
    columns = [
        "case",
        "impl",
        "variant",
        "ms",
        "tflops",
        "vs_cudnn-paged",
        "vs_cudnn-dense",
        "mixed_over_parts",
        "error",
    ]
    print_table(runner.records, columns)


if __name__ == "__main__":
    main()
