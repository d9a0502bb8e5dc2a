"""Probe (session 12): where the host time of a chunked prefill step's call goes.

python -m probes.step_host --chunks 512 --out FILE

Runs one 4096-token prompt in chunks through the engine under a jax.profiler trace with the
host tracer at its most detailed level and no Python tracer, and sums the host events of the
thread that calls the steps by name (digits folded), nested events included.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.e2e import _engine
from models.config import CONFIGS
from models.decoder import Decoder
from models.scheduler import SamplingParams


def _host_summary(path: str, top: int) -> dict:
    from jax._src.lib import _profile_data  # noqa: PLC0415

    out = {}
    for plane in _profile_data.ProfileData.from_file(path).planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            events = list(line.events)
            if len(events) < 50:
                continue
            by = collections.defaultdict(lambda: [0, 0.0])
            for e in events:
                name = re.sub(r"\d+", "#", e.name)[:100]
                by[name][0] += 1
                by[name][1] += e.duration_ns / 1e6
            rows = sorted(([n, c, round(ms, 3)] for n, (c, ms) in by.items()), key=lambda r: -r[2])
            out[line.name] = dict(events=len(events), top=rows[:top])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, nargs="+", default=[512])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--config", default="1b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len).tolist()
    params = SamplingParams(max_new_tokens=1)
    results = {}
    for chunk in args.chunks:
        engine = _engine(
            model,
            None,
            max_seqs=1,
            budget=chunk,
            max_len=args.prompt_len + 64,
            page_size=16,
            xla_options=None,
        )
        for _ in range(2):
            engine.generate([prompt], params)
        engine.stats = type(engine.stats)()
        start = time.perf_counter()
        engine.generate([prompt], params)
        wall = time.perf_counter() - start
        steps = engine.stats.steps + engine.stats.steps_in_flight
        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = 3
        options.python_tracer_level = 0
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d, profiler_options=options)
            engine.generate([prompt], params)
            jax.profiler.stop_trace()
            [path] = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
            lines = _host_summary(path, args.top)
        results[chunk] = dict(
            wall_ms=1e3 * wall,
            steps=steps,
            dispatch_ms=1e3 * engine.stats.dispatch_time,
            lines=lines,
        )
        print(f"== chunk {chunk}: wall {1e3 * wall:.2f} ms, {steps} steps")
        for name, line in lines.items():
            print(" ", name, line["events"])
            for row in line["top"][:40]:
                print("     ", row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
