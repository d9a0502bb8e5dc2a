"""The recorded H200 suites: decode, prefill and mixed batches against every anchor, in one run.

    python -m benchmarks.attention --suite decode prefill mixed --out "results/h200_{suite}.json"

bf16, Hq=32, Hkv=8, D=128; `benchmarks.inputs` builds the inputs and holds the timed functions,
`benchmarks.common` times them. This script picks the cases and the anchors and writes one JSON
file per suite: the environment header (GPU, jax, commit, date) and per measurement the shape,
implementation, CUPTI median kernel time, TB/s of unique KV (decode) or TFLOP/s (prefill, mixed)
and, for our kernels, `vs_<anchor>` = anchor time / our time, both measured in this run.

- decode: batch {1, 8, 64, 256} x context {512, 2048, 8192, 32768} x page {16, 64} where the KV
  fits in 2 GiB, B=64 ctx 4096 and ragged U[1, 4096]. Ours: Triton and Mosaic GPU decode
  kernels (defaults). Anchors: cuDNN paged (private JAX API), JAX's deprecated Pallas-Triton
  `paged_attention` (k_splits from `jax_k_splits`; also JAX's default 16 on headline cases) and
  the XLA reference on two cases. Every implementation reads the same pool of exactly the
  batch's pages in random order (cuDNN's requirement). Cases whose KV fits in the 60 MiB L2
  are marked `l2_resident`: their TB/s is not HBM bandwidth. First record: an HBM copy ceiling.
- prefill: causal prompts B=1 T {512, 2048, 8192, 16384} and B=4 T=2048 against cuDNN paged,
  cuDNN dense and JAX's Mosaic GPU FA3 (`attention_mgpu`, fp16: it fails on bf16 in 0.11.2);
  4 chunks of 512 or 2048 tokens on 2048- or 8192-token prefixes against the XLA reference only
  (cuDNN's causal mask is top-left, wrong for chunks: never timed there). First record: the
  XLA bf16 matmul ceiling (8192^3).
- mixed: chunks plus decode tokens in one ragged call, against its parts run separately (chunks
  by the ragged kernel, decodes by the fastest of the ragged, Triton and Mosaic decode kernels):
  an `impl="parts"` record whose `mixed_by` names the fastest kernel of the one call.
- shared_prefix: 8 prompts x 8 samples sharing 4096 or 16384 prompt tokens plus 128 tokens of
  their own, page 16: `shared_prefix_decode_attention` (groups found and planned untimed, as
  once per step, with a group slot per prompt; a variant with the default's 32 slots) against
  plain decode of the same K/V in per-sample copies (`private`) and
  through the shared page table (`plain`), by the Triton and Mosaic kernels. TB/s counts every
  sequence's K/V.

The suites stop starting cases once `--budget-s` (per suite) is spent: skipped cases are
recorded as such. A failing measurement records its error and the run goes on. `--quick`
runs the headline cases only; `--smoke` runs tiny shapes in interpret mode (any machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks import inputs as bi
from benchmarks.common import L2_BYTES, Runner, environment, error_text, kernel_time_ms, print_table
from benchmarks.inputs import Batch, DecodeCase
from jaxpaged import plan_cascade, quiet_triton_deprecation, shared_prefix_decode_attention
from jaxpaged.shared_prefix import default_prefix_splits
from pallas_kernels.common import H200_NUM_SMS

SUITES = ("decode", "prefill", "mixed", "shared_prefix")
# Default per-suite budgets (seconds of wall time, compiles included), sized so that the three
# suites fit in about 5 minutes of one device call.
BUDGET_S = {"decode": 130.0, "prefill": 100.0, "mixed": 30.0, "shared_prefix": 60.0}
OURS = ("triton", "mosaic")

# Decode: the largest KV (K plus V) a case may read; bigger cases are not run.
MAX_DECODE_KV_BYTES = 2 * 2**30
DECODE_HEADLINE = (
    DecodeCase("b64-ctx4096-p16", 64, 4096, 16, xla=True),
    DecodeCase("b64-ctx4096-p64", 64, 4096, 64),
    DecodeCase("b8-ctx32768-p64", 8, 32768, 64),
    DecodeCase("b1-ctx32768-p16", 1, 32768, 16),
    DecodeCase("b64-ragged4096-p16", 64, 4096, 16, ragged=True),
)
DECODE_SMOKE = (
    DecodeCase("b4-ctx256-p16", 4, 256, 16, xla=True),
    DecodeCase("b3-ragged256-p64", 3, 256, 64, ragged=True),
)
# Prefill: (batch, T) causal prompts and (chunk, prefix) chunks, 4 sequences each.
PROMPTS = ((1, 8192), (4, 2048), (1, 512), (1, 2048), (1, 16384))
CHUNKS = ((512, 2048), (2048, 8192), (512, 8192), (2048, 2048))
CHUNK_SEQS = 4
PROMPTS_SMOKE, CHUNKS_SMOKE = ((1, 64),), ((16, 48),)
# Mixed: arguments of `benchmarks.inputs.mixed_batches`.
MIXED = (
    dict(num_chunks=4, chunk=512, prefix=2048, num_decode=60),
    dict(num_chunks=2, chunk=2048, prefix=8192, num_decode=124),
)
MIXED_SMOKE = (dict(num_chunks=2, chunk=16, prefix=48, num_decode=5),)
# Shared prefixes: (prompts, samples per prompt, shared tokens, private tokens per sample).
SHARED_PREFIX = ((8, 8, 4096, 128), (8, 8, 16384, 128))
SHARED_PREFIX_SMOKE = ((2, 3, 32, 5),)


def decode_case(batch: int, ctx: int, page_size: int, ragged: bool = False) -> DecodeCase:
    kind = "ragged" if ragged else "ctx"
    return DecodeCase(f"b{batch}-{kind}{ctx}-p{page_size}", batch, ctx, page_size, ragged=ragged)


def decode_cases(quick: bool = False) -> list[DecodeCase]:
    """Headline cases first, so that a budget cut keeps them; then the grid and ragged p64."""
    if quick:
        return list(DECODE_HEADLINE)
    grid = [
        decode_case(b, ctx, p)
        for b in (1, 8, 64, 256)
        for ctx in (512, 2048, 8192, 32768)
        for p in (16, 64)
        if bi.kv_cache_bytes(b * ctx) <= MAX_DECODE_KV_BYTES
    ]
    grid.append(decode_case(64, 4096, 64, ragged=True))
    xla = {"b8-ctx2048-p16"}
    headline = {case.name for case in DECODE_HEADLINE}
    rest = [
        dataclasses.replace(case, xla=case.name in xla)
        for case in grid
        if case.name not in headline
    ]
    return [*DECODE_HEADLINE, *rest]


def jax_k_splits(batch: int, pages_per_seq: int) -> int:
    """k_splits for JAX's `paged_attention`: the fewest (a power of two dividing the pages of a
    sequence) that give its grid of B x Hkv x k_splits programs two per SM."""
    k = 1
    while batch * bi.NUM_KV_HEADS * k < 2 * H200_NUM_SMS and pages_per_seq % (2 * k) == 0:
        k *= 2
    return k


def add_ratios(records: list[dict], anchors: tuple[str, ...]) -> None:
    """`vs_<anchor>` on our records: the anchor's best time in the same case over ours."""
    for r in records:
        if r.get("impl") not in OURS or "ms" not in r:
            continue
        for anchor in anchors:
            times = [
                a["ms"]
                for a in records
                if a["case"] == r["case"] and a.get("impl") == anchor and "ms" in a
            ]
            if times:
                r[f"vs_{anchor}"] = min(times) / r["ms"]


def _skip(records: list[dict], case: str, **info) -> None:
    records.append(dict(case=case, error="skipped: --budget-s spent", **info))
    print(f"== {case}: skipped, budget spent", flush=True)


def hbm_copy_ceiling(num_bytes: int, iterations: int) -> dict:
    """An elementwise negation of `num_bytes` (read once, written once): HBM's practical rate."""
    record = dict(case="hbm-copy", impl="ceiling", variant="-x", bytes=2 * num_bytes)
    try:
        x = jax.random.normal(jax.random.key(0), (num_bytes // 2,), jnp.bfloat16)
        ms = kernel_time_ms(jnp.negative, x, iterations=iterations)
        record.update(ms=ms, tb_s=2 * num_bytes / ms / 1e9)
    except Exception as e:  # noqa: BLE001 - record and go on
        record["error"] = error_text(e)
    print(f"== hbm copy ceiling: {record.get('tb_s', record.get('error'))}", flush=True)
    return record


def matmul_ceiling(n: int, iterations: int) -> dict:
    """XLA's bf16 n^3 matmul: the compute ceiling prefill is plotted against."""
    record = dict(case=f"matmul-{n}", impl="ceiling", variant="xla bf16", flops=2 * n**3)
    try:
        a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in (0, 1))
        ms = kernel_time_ms(jnp.matmul, a, b, iterations=iterations)
        record.update(ms=ms, tflops=2 * n**3 / ms / 1e9)
    except Exception as e:  # noqa: BLE001 - record and go on
        record["error"] = error_text(e)
    print(f"== matmul ceiling: {record.get('tflops', record.get('error'))}", flush=True)
    return record


def run_decode(cases, *, interpret: bool, budget_s: float, iterations: int, smoke: bool):
    runner = Runner(budget_s, iterations, rate_key="tb_s", unit="TB/s")
    runner.records.append(hbm_copy_ceiling(2**23 if smoke else 2**31, iterations))
    headline = {case.name for case in DECODE_HEADLINE}
    for case in cases:
        shape = dict(
            batch=case.batch,
            ctx=case.ctx,
            page_size=case.page_size,
            ragged=case.ragged,
            headline=case.name in headline or smoke,
        )
        if runner.over_budget():
            _skip(runner.records, case.name, **shape)
            continue
        pages_per_seq = case.ctx // case.page_size
        inputs = bi.make_decode_inputs(case)
        shape.update(kv_bytes=inputs.kv_bytes, l2_resident=inputs.kv_bytes <= L2_BYTES)
        print(f"== {case.name}: {inputs.kv_bytes / 2**20:.0f} MiB of KV", flush=True)
        args = inputs.args()
        timed = [
            ("triton", "default", bi.triton_decode_fn(interpret), args),
            ("mosaic", "default", bi.mosaic_decode_fn, args),
            ("cudnn-paged", "paged", bi.cudnn_decode_fn, args),
        ]
        k_t, v_t = (jnp.transpose(x, (2, 0, 1, 3)) for x in (inputs.k, inputs.v))
        jax_args = (inputs.q, k_t, v_t, inputs.kv_lens, inputs.table)
        splits = [jax_k_splits(case.batch, pages_per_seq)]
        if case.name in headline and pages_per_seq % 16 == 0 and splits[0] != 16:
            splits.append(16)  # JAX's default
        for k in splits:
            fn = bi.jax_pallas_decode_fn(k, interpret)
            timed.append(("jax-pallas", f"k_splits={k}", fn, jax_args))
        if case.xla:
            timed.append(("xla", "reference", bi.xla_decode_fn, args))
        for impl, variant, fn, fn_args in timed:
            runner.record(case.name, impl, variant, fn, *fn_args, work=inputs.kv_bytes, **shape)
        del inputs, args, jax_args, k_t, v_t, timed  # free this case's pool before the next
    add_ratios(runner.records, ("cudnn-paged", "jax-pallas", "xla"))
    return runner.records


def run_prefill(
    prompts, chunks, *, interpret: bool, budget_s: float, iterations: int, smoke: bool
) -> list[dict]:
    runner = Runner(budget_s, iterations, rate_key="tflops", unit="TFLOP/s")
    runner.records.append(matmul_ceiling(256 if smoke else 8192, iterations))
    batches = [
        (
            Batch(f"b{b}-t{t}", ((t, t),) * b),
            dict(num_seqs=b, q_len=t, kv_len=t, causal=True),
        )
        for b, t in prompts
    ]
    batches += [
        (
            Batch(f"b{CHUNK_SEQS}-c{c}-prefix{p}", ((c, p + c),) * CHUNK_SEQS),
            dict(num_seqs=CHUNK_SEQS, q_len=c, kv_len=p + c, causal=True, chunk=True),
        )
        for c, p in chunks
    ]
    xla_cases = {batches[-1][0].name} if smoke else {f"b{CHUNK_SEQS}-c512-prefix2048"}
    for i, (batch, shape) in enumerate(batches):
        shape.update(page_size=bi.PREFILL_PAGE_SIZE, headline=i < 2 or smoke, flops=batch.flops)
        if runner.over_budget():
            _skip(runner.records, batch.name, **shape)
            continue
        print(f"== {batch.name}: {batch.flops / 1e12:.3f} TFLOP", flush=True)
        inputs = bi.make_prefill_inputs(batch)
        args = inputs.args()
        timed = [("triton", "default", bi.ragged_fn("triton", interpret), args)]
        if not interpret:
            timed.append(("mosaic", "default", bi.ragged_fn("mosaic"), args))
        if not shape.get("chunk"):  # cuDNN's and FA3's causal masks are top-left
            k, v = bi.dense_kv(inputs)
            q = inputs.q.reshape(shape["num_seqs"], -1, *inputs.q.shape[1:])
            timed += [
                ("cudnn-paged", "causal", bi.cudnn_paged_prefill_fn, args),
                ("cudnn-dense", "causal", bi.cudnn_dense_prefill_fn, (inputs.q, k, v, args[3])),
                (
                    "mosaic-fa3",
                    "fp16 dense causal",
                    bi.mosaic_fa3_fn,
                    tuple(x.astype(jnp.float16) for x in (q, k, v)),
                ),
            ]
        if batch.name in xla_cases:
            timed.append(("xla", "reference", bi.ragged_fn("xla"), args))
        for impl, variant, fn, fn_args in timed:
            runner.record(batch.name, impl, variant, fn, *fn_args, work=batch.flops, **shape)
        del inputs, args, timed
    add_ratios(runner.records, ("cudnn-paged", "cudnn-dense", "mosaic-fa3", "xla"))
    return runner.records


def run_mixed(configs, *, interpret: bool, budget_s: float, iterations: int, smoke: bool):
    runner = Runner(budget_s, iterations, rate_key="tflops", unit="TFLOP/s")
    for i, config in enumerate(configs):
        mixed, chunks, decodes = bi.mixed_batches(**config)
        tag = "mixed-c{chunk}x{num_chunks}-prefix{prefix}-d{num_decode}".format(**config)
        mixed, chunks, decodes = (
            dataclasses.replace(b, name=tag + b.name.removeprefix("mixed"))
            for b in (mixed, chunks, decodes)
        )
        shape = dict(mixed=tag, headline=i == 0, page_size=bi.PREFILL_PAGE_SIZE, **config)
        if runner.over_budget():
            _skip(runner.records, mixed.name, **shape)
            continue
        print(f"== {tag}: {mixed.flops / 1e12:.3f} TFLOP in {len(mixed.seqs)} seqs", flush=True)
        # Every part by each ragged kernel, the decodes also by the decode kernels; `best`
        # names the fastest per part.
        ms, best = {}, {}
        ragged = [("triton", bi.ragged_fn("triton", interpret))]
        if not interpret:
            ragged.append(("mosaic", bi.ragged_fn("mosaic")))
        decode_kernels = [
            ("triton-decode", bi.public_triton_decode_fn(interpret)),
            ("mosaic-decode", bi.mosaic_decode_fn),
        ]
        for batch in (mixed, chunks, decodes):
            args = bi.make_prefill_inputs(batch).args()
            part = batch.name.removeprefix(tag).lstrip(":") or "mixed"
            kernels = [(impl, fn, args) for impl, fn in ragged]
            if batch is decodes:  # q_len 1 everywhere: (q, k, v, kv_lens, table) of decode
                kernels += [(impl, fn, args[:5]) for impl, fn in decode_kernels]
            for impl, fn, fn_args in kernels:
                record = runner.record(
                    batch.name, impl, "default", fn, *fn_args, work=batch.flops, part=part, **shape
                )
                if record.get("ms") and record["ms"] < ms.get(batch.name, float("inf")):
                    ms[batch.name], best[batch.name] = record["ms"], impl
        if i == 0:
            args = bi.make_prefill_inputs(mixed).args()
            xla = bi.ragged_fn("xla")
            runner.record(mixed.name, "xla", "reference", xla, *args, work=mixed.flops, **shape)
        if ms.get(chunks.name) and ms.get(decodes.name):
            parts = ms[chunks.name] + ms[decodes.name]
            runner.records.append(
                dict(
                    case=mixed.name,
                    impl="parts",
                    variant=f"chunks by {best[chunks.name]} + decodes by {best[decodes.name]}",
                    ms=parts,
                    tflops=mixed.flops / parts / 1e9,
                    **shape,
                )
            )
            if mixed.name in best:
                runner.records[-1]["mixed_by"] = best[mixed.name]
    add_ratios(runner.records, ("parts", "xla"))
    return runner.records


def run_shared_prefix(cases, *, interpret: bool, budget_s: float, iterations: int, smoke: bool):
    runner = Runner(budget_s, iterations, rate_key="tb_s", unit="TB/s")
    # The smoke run takes the XLA reference: three interpreted Triton kernels compile slowly.
    ours = ("xla",) if interpret else OURS
    plain = {"triton": bi.public_triton_decode_fn(False), "mosaic": bi.mosaic_decode_fn}
    plain["xla"] = bi.xla_decode_fn
    for prompts, samples, shared, private in cases:
        name = f"{prompts}x{samples}-shared{shared}-private{private}"
        shape = dict(prompts=prompts, samples=samples, shared=shared, private=private)
        if runner.over_budget():
            _skip(runner.records, name, **shape)
            continue
        # The plan's group slots: one per prompt, as a rollout engine of `samples` samples a
        # request sets them (`EngineConfig.max_prefix_groups`); and, as a variant, every
        # group a batch of this size may have (the default).
        args, private_table = bi.make_shared_prefix_inputs(
            prompts, samples, shared, private, max_groups=prompts
        )
        every_slot = plan_cascade(args[5].groups, args[4], args[3], page_size=16)
        kv_bytes = bi.kv_cache_bytes(prompts * samples * (shared + private))
        print(f"== {name}: {kv_bytes / 2**20:.0f} MiB of KV over the sequences", flush=True)
        for impl in ours:
            op = functools.partial(shared_prefix_decode_attention, implementation=impl)
            runner.record(name, impl, "cascade", op, *args, work=kv_bytes, **shape)
            variant = f"cascade, {every_slot.prefix_members.shape[0]} group slots"
            runner.record(name, impl, variant, op, *args[:5], every_slot, work=kv_bytes, **shape)
            if impl != "xla":  # the reference takes no splits; the default's neighbours
                k = default_prefix_splits(
                    impl, prompts, bi.NUM_KV_HEADS, shared + private, bi.HEAD_DIM, bi.DTYPE
                )
                for splits in sorted({max(1, k // 2), 2 * k}):
                    fn = functools.partial(op, prefix_num_splits=splits)
                    variant = f"cascade, prefix splits {splits}"
                    runner.record(name, impl, variant, fn, *args, work=kv_bytes, **shape)
            for anchor, table in (("private", private_table), ("plain", args[4])):
                runner.record(
                    name, anchor, impl, plain[impl], *args[:4], table, work=kv_bytes, **shape
                )
        del args, private_table
    add_ratios(runner.records, ("private", "plain"))
    return runner.records


def write(path: Path, suite: str, records: list[dict], wall_s: float, argv: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "suite": suite,
        **environment(),
        "dtype": "bfloat16",
        "num_q_heads": bi.NUM_Q_HEADS,
        "num_kv_heads": bi.NUM_KV_HEADS,
        "head_dim": bi.HEAD_DIM,
        "command": "python -m benchmarks.attention " + " ".join(argv),
        "wall_s": round(wall_s, 1),
    }
    path.write_text(json.dumps({**header, "cases": records}, indent=1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", nargs="+", choices=SUITES, required=True)
    parser.add_argument(
        "--out", required=True, help="JSON file per suite; '{suite}' is replaced by its name"
    )
    parser.add_argument("--budget-s", type=float, default=None, help="per suite (default: sized)")
    parser.add_argument("--quick", action="store_true", help="headline cases only")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes in interpret mode (any machine)"
    )
    a = parser.parse_args(argv)
    if len(a.suite) > 1 and "{suite}" not in a.out:
        parser.error("--out needs '{suite}' when several suites run")
    iterations = 1 if a.smoke else 20
    options = dict(interpret=a.smoke, iterations=iterations, smoke=a.smoke)
    for suite in a.suite:
        start = time.monotonic()
        budget = a.budget_s if a.budget_s is not None else BUDGET_S[suite]
        with quiet_triton_deprecation():
            if suite == "decode":
                cases = DECODE_SMOKE if a.smoke else decode_cases(a.quick)
                records = run_decode(cases, budget_s=budget, **options)
                columns = ["case", "impl", "variant", "ms", "tb_s", "vs_cudnn-paged", "error"]
            elif suite == "prefill":
                prompts = PROMPTS_SMOKE if a.smoke else PROMPTS[: 2 if a.quick else None]
                chunks = CHUNKS_SMOKE if a.smoke else CHUNKS[: 1 if a.quick else None]
                records = run_prefill(prompts, chunks, budget_s=budget, **options)
                columns = ["case", "impl", "variant", "ms", "tflops", "vs_cudnn-paged", "error"]
            elif suite == "mixed":
                configs = MIXED_SMOKE if a.smoke else MIXED[: 1 if a.quick else None]
                records = run_mixed(configs, budget_s=budget, **options)
                columns = ["case", "impl", "variant", "ms", "tflops", "vs_parts", "error"]
            else:
                cases = SHARED_PREFIX_SMOKE if a.smoke else SHARED_PREFIX[: 1 if a.quick else None]
                records = run_shared_prefix(cases, budget_s=budget, **options)
                columns = ["case", "impl", "variant", "ms", "tb_s", "vs_private", "vs_plain"]
        wall_s = time.monotonic() - start
        path = Path(a.out.format(suite=suite))
        write(path, suite, records, wall_s, argv)
        print(f"\n{suite}: {len(records)} records in {wall_s:.0f} s, written to {path}")
        print_table(records, columns)


if __name__ == "__main__":
    main()
