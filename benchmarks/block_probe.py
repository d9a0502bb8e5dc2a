"""PROBE (session 8): decode blocks of the `1b` decoder under XLA options, against per-step decode.

    python -m benchmarks.block_probe --out $OUT/block_probe.json --hlo-dir $OUT/hlo

Each case prefills `batch` prompts of `--ctx` tokens, then times the decode-only part of
generation (engine wall time) and, with `--profile`, its CUPTI kernels per decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.e2e import _kernel_kind
from models.config import CONFIGS, EngineConfig
from models.decoder import Decoder
from models.engine import SMALL_STEP_XLA_OPTIONS, Engine
from models.scheduler import SamplingParams

OPTIONS = {
    "graph1": (("xla_gpu_graph_min_graph_size", 1),),
    "graph1+while": SMALL_STEP_XLA_OPTIONS,
    "cublas": SMALL_STEP_XLA_OPTIONS + (("xla_gpu_enable_triton_gemm", False),),
    "no-cmdbuf": (("xla_gpu_enable_command_buffer", ""),),
}


def _prefill(engine: Engine, prompts, params):
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(s.num_cached < s.prompt_len for s in seqs):
        engine.step()
    return seqs


def _decode(engine: Engine, prompts, params, profile: bool):
    _prefill(engine, prompts, params)
    before = (engine.stats.decode_tokens, engine.stats.decode_steps)
    if profile:
        from jax._src.lib import mosaic_gpu  # noqa: PLC0415

        ext = mosaic_gpu._mosaic_gpu_ext
        ext._cupti_init()
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    timings = ext._cupti_get_timings(True) if profile else []
    tokens = engine.stats.decode_tokens - before[0]
    steps = engine.stats.decode_steps - before[1]
    result = dict(
        tokens_per_s=tokens / seconds, wall_ms_per_step=1e3 * seconds / steps, steps=steps
    )
    if profile:
        by_kind, by_name = {}, {}
        for name, ms in timings:
            by_kind[_kernel_kind(name)] = by_kind.get(_kernel_kind(name), 0.0) + ms
            by_name[name] = by_name.get(name, 0.0) + ms
        result.update(
            gpu_ms_per_step=sum(by_kind.values()) / steps,
            gpu_ms_per_step_by_kind={k: v / steps for k, v in by_kind.items()},
            kernels_per_step=len(timings) / steps,
            top_kernels=[
                (n[:90], ms / steps, sum(1 for m, _ in timings if m == n) / steps)
                for n, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
            ],
        )
    return result


def splits_cases(ctx: int) -> list[dict]:
    """The decode op alone at the `1b` shape (Hq 16, Hkv 8, D 128, page 16, ctx tokens), per
    split count: B=1 as the engine runs it (two slots, one inactive), B=16, B=64."""
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxpaged  # noqa: PLC0415
    from benchmarks.common import kernel_breakdown_ms  # noqa: PLC0415

    out = []
    page, pages_per_seq = 16, -(-(ctx + 137) // 16)
    for slots, active in ((2, 1), (16, 16), (64, 64)):
        keys = jax.random.split(jax.random.key(slots), 3)
        num_pages = slots * pages_per_seq
        k = jax.random.normal(keys[0], (num_pages, page, 8, 128), jnp.bfloat16)
        v = jax.random.normal(keys[1], (num_pages, page, 8, 128), jnp.bfloat16)
        q = jax.random.normal(keys[2], (slots, 16, 128), jnp.bfloat16)
        lens = jnp.where(jnp.arange(slots) < active, ctx, 0).astype(jnp.int32)
        table = jnp.arange(num_pages, dtype=jnp.int32).reshape(slots, pages_per_seq)
        for impl in ("mosaic", "triton"):
            for splits in (None, 1, 2, 4, 8, 16):
                fn = jax.jit(
                    lambda q, k, v, lens, table, impl=impl, splits=splits: (
                        jaxpaged.paged_decode_attention(
                            q, k, v, lens, table, num_splits=splits, implementation=impl
                        )
                    )
                )
                try:
                    kernels = kernel_breakdown_ms(fn, q, k, v, lens, table)
                    rec = dict(
                        slots=slots,
                        active=active,
                        impl=impl,
                        splits=splits,
                        us=1e3 * sum(ms for _, ms in kernels),
                        kernels=[(n[:40], 1e3 * ms) for n, ms in kernels],
                    )
                except Exception as e:  # noqa: BLE001
                    rec = dict(slots=slots, impl=impl, splits=splits, error=str(e)[:300])
                print(json.dumps(rec), flush=True)
                out.append(rec)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="1b")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--out", default="block_probe.json")
    parser.add_argument("--hlo-dir", default=None)
    parser.add_argument("--splits", action="store_true")
    args = parser.parse_args()
    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    cases = args.cases or [
        "1:none:graph1",
        "1:16:graph1",
        "1:16:graph1+while",
        "1:16:no-cmdbuf",
        "1:64:graph1+while",
        "16:16:graph1",
        "16:16:graph1+while",
        "64:16:graph1",
        "64:16:graph1+while",
    ]
    results = splits_cases(args.ctx) if args.splits else []
    for spec in cases:
        batch, steps, option = spec.split(":")
        batch = int(batch)
        steps = None if steps == "none" else int(steps)
        max_len = args.ctx + args.new_tokens + 8
        config = EngineConfig(
            page_size=16,
            num_pages=batch * (-(-max_len // 16)),
            max_seqs=batch,
            max_tokens_per_step=2048,
            max_model_len=max_len,
            decode_steps=steps,
        )
        record = dict(case=spec, batch=batch, decode_steps=steps, options=option)
        try:
            engine = Engine(model, config, xla_options=OPTIONS[option])
            prompts = rng.integers(0, model.config.vocab_size, (batch, args.ctx)).tolist()
            params = SamplingParams(max_new_tokens=args.new_tokens)
            t0 = time.perf_counter()
            _decode(engine, [p[:40] for p in prompts], params, profile=False)  # compile
            record["warmup_s"] = time.perf_counter() - t0
            record.update(_decode(engine, prompts, params, profile=False))
            record["profiled"] = _decode(engine, prompts, params, profile=True)
            if args.hlo_dir and steps is not None and batch == 1:
                os.makedirs(args.hlo_dir, exist_ok=True)
                inputs = engine._block_inputs([])
                text = (
                    engine.block_fn.lower(
                        engine.param_leaves,
                        engine.kv_pages,
                        engine.pool,
                        inputs,
                        num_steps=steps,
                        implementation=None,
                    )
                    .compile()
                    .as_text()
                )
                name = re.sub(r"[^\w]+", "_", spec)
                with open(os.path.join(args.hlo_dir, f"block_{name}.txt"), "w") as f:
                    f.write(text)
                record["hlo_fusion_kinds"] = {
                    k: len(re.findall(k, text))
                    for k in (
                        "loop_multiply_fusion",
                        "input_reduce_fusion",
                        "gemm_fusion",
                        "custom-call",
                    )
                }
        except Exception as e:  # noqa: BLE001 - a probe records what failed and goes on
            record["error"] = f"{type(e).__name__}: {str(e)[:800]}"
        print(json.dumps(record), flush=True)
        results.append(record)
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), results=results), f, indent=1)


if __name__ == "__main__":
    main()
