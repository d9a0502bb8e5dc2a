"""Probe (session 11): where a chunked prefill step's wall time goes on the host.

python -m probes.prefill_host --chunks 512 2048 4096 --out DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile
import time

import jax
import numpy as np
from flax import nnx

import models.engine as engine_mod
from benchmarks.e2e import _engine
from models.config import CONFIGS
from models.decoder import Decoder
from models.engine import step_xla_options
from models.scheduler import SamplingParams


def _summary(path: str) -> dict:
    from jax._src.lib import _profile_data  # noqa: PLC0415

    summary = {}
    for plane in _profile_data.ProfileData.from_file(path).planes:
        for line in plane.lines:
            events = sorted(line.events, key=lambda e: e.start_ns)
            if len(events) < 3:
                continue
            by_name: dict[str, list] = {}
            for e in events:
                entry = by_name.setdefault(e.name[:90], [0, 0.0])
                entry[0] += 1
                entry[1] += e.duration_ns / 1e6
            case = dict(
                events=len(events),
                span_ms=(events[-1].end_ns - events[0].start_ns) / 1e6,
                busy_ms=sum(e.duration_ns for e in events) / 1e6,
                top=sorted(([n, c, ms] for n, (c, ms) in by_name.items()), key=lambda t: -t[2])[
                    :30
                ],
            )
            summary[f"{plane.name} | {line.name}"] = case
    return summary


class Timer:
    def __init__(self):
        self.t = {}

    def wrap(self, name, fn):
        def wrapped(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - start

        return wrapped


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--config", default="1b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_len).tolist()
    results = {}
    for chunk in args.chunks:
        engine = _engine(
            model,
            None,
            max_seqs=1,
            budget=chunk,
            max_len=args.prompt_len + 64,
            page_size=16,
            xla_options=lambda n, d: step_xla_options(n, decode=d),
        )
        params = SamplingParams(max_new_tokens=1)
        engine.generate([prompt], params)  # compile
        engine.generate([prompt], params)
        engine.stats = type(engine.stats)()
        timer = Timer()
        orig_step_fn = engine.step_fn

        def step_fn(*a, _orig=orig_step_fn, **k):
            return timer.wrap("call", _orig(*a, **k))  # noqa: B023

        engine.step_fn = step_fn
        engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
        engine.scheduler.update = timer.wrap("update", engine.scheduler.update)
        engine._inputs = timer.wrap("inputs", engine._inputs)
        orig_get = jax.device_get
        engine_mod.jax.device_get = timer.wrap("device_get", orig_get)
        reps = 5
        start = time.perf_counter()
        for _ in range(reps):
            engine.generate([prompt], params)
        wall = time.perf_counter() - start
        engine_mod.jax.device_get = orig_get
        steps = engine.stats.steps
        per = {k: 1e3 * v / steps for k, v in timer.t.items()}
        per["wall"] = 1e3 * wall / steps
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                engine.generate([prompt], params)
            [path] = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
            lines = _summary(path)
        results[chunk] = dict(ms_per_step=per, steps_per_prompt=steps / reps, lines=lines)
        print(f"== chunk {chunk}: ms per step", {k: round(v, 3) for k, v in per.items()})
        for key, case in lines.items():
            if case["busy_ms"] > 1:
                print(" ", key, {k: v for k, v in case.items() if k != "top"})
                for entry in case["top"][:14]:
                    print("     ", entry)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
