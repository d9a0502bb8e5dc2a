"""Probe: where a decode window's wall time goes beyond its kernels (issue 20).

`benchmarks.e2e` times a window of decode blocks (B rows, `--new-tokens` - 1 steps, blocks of
`EngineConfig.decode_steps`) from the first block's launch to the last block's sync. At B=16
that wall time is ~3% over the kernels' CUPTI time, and the engine's calls take ~0.3 ms of host
time a step (~4.9 ms a block of 16) against ~0.14 at B=1. This runs the same window as e2e
under `jax.profiler` and reports, per host thread and GPU stream, the events summed by name;
for the GPU streams the gaps between kernels (how many, their sum, the largest with their
offset from the first kernel); and the host's calls of the block function with their
durations, against when the GPU's first kernel started.

`--chunks` does the same for one `--prompt-len` prompt in chunks of that size (the calls of
the step function). XLA runs command buffers op by op while a profiler is on unless
`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`; with
`TF_CPP_VMODULE=command_buffer_thunk=3` its log also says what each update re-recorded.
(Session 11's draft of the same probe, `01333d5:benchmarks/host_trace.py`, found B=1 blocks
spending 2.6 ms of host time a call, 1.0 of it updating command buffers; runs 180-182 here.)

    python -m probes.host_trace --batches 1 16 --chunks 512 --out trace.json
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

from benchmarks.common import environment
from benchmarks.e2e import _decode_budget, _decode_part, _engine
from models.config import CONFIGS
from models.decoder import Decoder
from models.engine import Stats
from models.scheduler import SamplingParams


def _lines(path: str, call_name: str = "PjitFunction(block)") -> dict:
    """Per (plane, line) of the trace: event count, span, busy time and the costliest event
    names; for GPU lines also the gaps between consecutive events."""
    out = {}
    for plane in _profile_data.ProfileData.from_file(path).planes:
        for line in plane.lines:
            events = sorted(line.events, key=lambda e: e.start_ns)
            if len(events) < 3:
                continue
            by_name: dict[str, list] = {}
            for e in events:
                entry = by_name.setdefault(e.name[:80], [0, 0.0])
                entry[0] += 1
                entry[1] += e.duration_ns / 1e6
            case = dict(
                events=len(events),
                first_ns=events[0].start_ns,
                span_ms=(events[-1].end_ns - events[0].start_ns) / 1e6,
                busy_ms=sum(e.duration_ns for e in events) / 1e6,
                top=sorted(([n, c, ms] for n, (c, ms) in by_name.items()), key=lambda t: -t[2])[
                    :50
                ],
            )
            if "/device:GPU" in plane.name:
                gaps = [
                    ((b.start_ns - a.end_ns) / 1e3, (a.end_ns - events[0].start_ns) / 1e6)
                    for a, b in zip(events, events[1:], strict=False)
                ]
                case.update(
                    gap_ms=sum(g for g, _ in gaps if g > 0) / 1e3,
                    gaps_over_5us=sum(g > 5 for g, _ in gaps),
                    gaps_over_5us_ms=sum(g for g, _ in gaps if g > 5) / 1e3,
                    largest_gaps_us_at_ms=sorted(gaps, reverse=True)[:12],
                )
            else:
                calls = []
                for e in events:  # the outermost calls of the jitted function
                    if e.name == call_name and (
                        not calls or e.start_ns >= calls[-1].start_ns + calls[-1].duration_ns
                    ):
                        calls.append(e)
                if calls:
                    case["calls"] = [
                        [(e.start_ns - events[0].start_ns) / 1e6, e.duration_ns / 1e6]
                        for e in calls
                    ]
                    # What the host does inside the first two calls and the last: the events
                    # nested in each (Python frames left out), summed by name.
                    case["inside_calls"] = [
                        _inside(events, call) for call in (calls[:2] + calls[-1:])
                    ]
            out[f"{plane.name} | {line.name}"] = case
    return out


def _inside(events, call) -> list:
    """The events of `events` nested in `call`, but Python frames, summed by name: [name,
    count, ms], the costliest first."""
    end = call.start_ns + call.duration_ns
    by_name: dict[str, list] = {}
    for e in events:
        if e is call or e.name.startswith("$") or not call.start_ns <= e.start_ns < end:
            continue
        entry = by_name.setdefault(e.name[:80], [0, 0.0])
        entry[0] += 1
        entry[1] += e.duration_ns / 1e6
    return sorted(([n, c, round(ms, 4)] for n, (c, ms) in by_name.items()), key=lambda t: -t[2])[
        :40
    ]


def _traced(run, call_name: str) -> tuple[object, dict]:
    """`run()` under `jax.profiler`: its result and the trace's lines (`_lines`)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            result = run()
        [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        return result, _lines(path, call_name)


def _report(case: dict) -> None:
    print(json.dumps({k: v for k, v in case.items() if k != "lines"}))
    for key, line in case["lines"].items():
        if line["busy_ms"] > 1:
            print(key, {k: v for k, v in line.items() if k not in ("top", "inside_calls")})
            for entry in line["top"][:10]:
                print("   ", entry)


def _decode_case(model, rng, batch: int, args) -> dict:
    prompts = rng.integers(0, model.config.vocab_size, (batch, args.ctx))
    steps, budget = args.new_tokens - 1, max(2048, args.ctx)
    max_len = args.ctx + _decode_budget(batch, args.ctx, steps, budget) + 1
    engine = _engine(
        model, None, max_seqs=batch, budget=budget, max_len=max_len, page_size=16, xla_options=None
    )
    _decode_part(engine, prompts[:, :16].tolist(), steps)  # compile
    untraced = _decode_part(engine, prompts.tolist(), steps)
    traced, lines = _traced(
        lambda: _decode_part(engine, prompts.tolist(), steps), "PjitFunction(block)"
    )
    return dict(batch=batch, untraced=untraced, traced=traced, lines=lines)


def _prefill_case(model, rng, chunk: int, args) -> dict:
    """One prompt of `--prompt-len` tokens in chunks of `chunk`, as e2e's prefill rows run it."""
    prompt = rng.integers(0, model.config.vocab_size, args.prompt_len).tolist()
    engine = _engine(
        model,
        None,
        max_seqs=1,
        budget=chunk,
        max_len=args.prompt_len + 1,
        page_size=16,
        xla_options=None,
    )
    params = SamplingParams(max_new_tokens=1)

    def run():
        engine.stats = Stats()
        engine.generate([prompt], params)
        stats = engine.stats
        return dict(
            steps=stats.steps,
            wall_ms_per_step=1e3 * stats.prefill_time / stats.prefill_steps,
            dispatch_ms_per_step=1e3 * stats.dispatch_time / stats.steps,
        )

    run()  # compile
    untraced = run()
    traced, lines = _traced(run, "PjitFunction(step)")
    return dict(chunk=chunk, untraced=untraced, traced=traced, lines=lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--chunks", type=int, nargs="*", default=[], help="prefill chunk sizes")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    results = []
    for chunk in args.chunks:
        results.append(_prefill_case(model, rng, chunk, args))
        _report(results[-1])
    for batch in args.batches:
        results.append(_decode_case(model, rng, batch, args))
        _report(results[-1])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="host_trace", cases=results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
