"""Where a decode block's wall time goes beyond its kernels: the engine's decode blocks under
`jax.profiler`, the trace's events summed by name per host thread and GPU stream, and the GPU
streams' gaps between kernels.

    python -m benchmarks.host_trace --batch 64 [--xla-option NAME=VALUE ...] --out trace.json

`--profile` of `benchmarks.e2e` gives the GPU time per step; this gives the host side (time
inside `PjitFunction(block)`, command buffer updates, a while loop the host drives).
"""

from __future__ import annotations

import argparse
import glob
import json
import tempfile

import jax
import numpy as np
from flax import nnx
from jax._src.lib import _profile_data  # private: reads the trace's XSpace

from benchmarks.e2e import _decode_part, _engine, _xla_option
from models.config import CONFIGS
from models.decoder import Decoder
from models.engine import step_xla_options
from models.scheduler import SamplingParams


def _summary(path: str) -> dict:
    """Per (plane, line): event count, busy time and the 25 costliest event names; for GPU
    streams also the gaps between consecutive kernels."""
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
                    :25
                ],
            )
            if "/device:GPU" in plane.name:
                gaps = (
                    np.array(
                        [b.start_ns - a.end_ns for a, b in zip(events, events[1:], strict=False)]
                    )
                    / 1e3
                )
                case.update(
                    gap_ms=float(gaps[gaps > 0].sum() / 1e3), gaps_over_20us=int((gaps > 20).sum())
                )
            summary[f"{plane.name} | {line.name}"] = case
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=65)
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    extra = tuple(_xla_option(text) for text in args.xla_option)
    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    engine = _engine(
        model,
        None,
        max_seqs=args.batch,
        budget=max(2048, args.ctx),
        max_len=args.ctx + args.new_tokens + 1,
        page_size=16,
        xla_options=lambda n, d: step_xla_options(n, decode=d) + extra,
    )
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, args.ctx))
    params = SamplingParams(max_new_tokens=args.new_tokens)
    _decode_part(engine, prompts[:, :16].tolist(), params)  # compile
    seqs = [engine.add_request(p, params) for p in prompts.tolist()]
    while any(s.num_cached < s.prompt_len for s in seqs):
        engine.step()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            while engine.has_work():
                engine.step()
        [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        result = dict(batch=args.batch, xla_options=extra, lines=_summary(path))
    for key, case in result["lines"].items():
        if case["busy_ms"] > 1:
            print(key, {k: v for k, v in case.items() if k != "top"})
            for entry in case["top"][:12]:
                print("   ", entry)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
