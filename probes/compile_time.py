"""Probe (run 87): how long the engine's first decode takes to compile, with and without
extra XLA options (e.g. `xla_gpu_exhaustive_tiling_search=true`, which run 86 measured 2.7%
faster at B=64). Run each option set in its own process: XLA's autotuner caches per process.

    python -m probes.compile_time --batch 64 [--xla-option NAME=VALUE ...]
"""

import argparse
import json
import time

import numpy as np
from flax import nnx

from benchmarks import e2e
from models.config import CONFIGS
from models.decoder import Decoder
from models.engine import step_xla_options


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--xla-option", action="append", default=[])
    args = parser.parse_args()
    extra = tuple(e2e._xla_option(text) for text in args.xla_option)
    model = Decoder(CONFIGS["1b"], rngs=nnx.Rngs(0))
    steps, budget = 128, max(2048, args.ctx)
    max_len = args.ctx + e2e._decode_budget(args.batch, args.ctx, steps, budget) + 1
    engine = e2e._engine(
        model,
        None,
        max_seqs=args.batch,
        budget=budget,
        max_len=max_len,
        page_size=16,
        xla_options=lambda n, **kind: step_xla_options(n, **kind) + extra,
    )
    prompts = np.random.default_rng(0).integers(0, 32_000, (args.batch, 16)).tolist()
    start = time.perf_counter()
    e2e._decode_part(engine, prompts, steps)  # compiles every step kind it meets
    first = time.perf_counter() - start
    start = time.perf_counter()
    e2e._decode_part(engine, prompts, steps)
    second = time.perf_counter() - start
    print(
        json.dumps(dict(batch=args.batch, options=args.xla_option, first_s=first, second_s=second))
    )


if __name__ == "__main__":
    main()
