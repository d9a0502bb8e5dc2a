"""Probe: a mixed step that samples, in command buffers or op by op, at each of its sizes.

Session 41 found the serving admissions' mixed steps (a prompt chunk beside the running rows'
decode tokens, read at once) at 6.0-8.1 ms from launch to read where their GPU work is ~3 ms,
and 5.9-6.2 ms with every size in command buffers (run 216, one size in another process).
The engine's rule then, command buffers up to 512 tokens, was measured on prompt chunks that
overlap the host's launch with the step before them (run 220 measured this probe and moved
the rule for steps that sample to 2048 tokens). This times the same admission, one engine per
`--graphs-up-to`, in one process: `--running` rows decode at about `--ctx` tokens, and a
request of (size - max_seqs) prompt tokens arrives and is read after its first token, at each
of the engine's `EngineConfig.step_token_counts`. The engines take turns, rep by rep, so that
both see the same contexts; neither compiles after its warm-up (a compile evicts every
executable's CUDA graphs). Per (graphs_up_to, size): the launch-to-read time of the step
(`Stats.prefill_time`) and the host's time inside the jitted call (`Stats.dispatch_time`),
median and spread over `--reps`; with `--profile`, then one more admission a case under CUPTI
(its kernels' summed time and count); with `--trace`, one admission a case under
`jax.profiler`: where its launch-to-read goes, before, on and after the GPU (run 230).

    python -m probes.mixed_step --graphs-up-to 512 2048 --reps 12 --out mixed.json
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

from benchmarks.common import environment, roomy_engine_config
from benchmarks.e2e import _discard_first_capture
from models.config import CONFIGS
from models.decoder import Decoder
from models.engine import Engine, step_xla_options
from models.scheduler import SamplingParams


def _admit(engine: Engine, prompt: list[int], profile: bool = False) -> tuple[float, ...]:
    """Add a one-token request beside the running rows and run until it is read; returns the
    launch-to-read and dispatch seconds of its mixed step (and with `profile` its kernels'
    CUPTI milliseconds and count)."""
    seq = engine.add_request(prompt, SamplingParams(1))
    engine.sync()  # the block in flight, if any: the admission then starts on an idle GPU
    stats = engine.stats
    steps, elapsed, dispatch = stats.prefill_steps, stats.prefill_time, stats.dispatch_time
    if profile:
        from jax._src.lib import mosaic_gpu  # noqa: PLC0415 - private, GPU only

        mosaic_gpu._mosaic_gpu_ext._cupti_init()
    engine.step()
    kernels = mosaic_gpu._mosaic_gpu_ext._cupti_get_timings(True) if profile else []
    if stats.prefill_steps != steps + 1 or not seq.finished:
        raise RuntimeError("the admission did not run as one mixed step that samples")
    gpu = (sum(ms for _, ms in kernels), len(kernels)) if profile else ()
    return stats.prefill_time - elapsed, stats.dispatch_time - dispatch, *gpu


def _after_call(path: str, call_name: str) -> dict:
    """From the trace at `path`: per line, the events that start after the first `call_name`
    call ends, as [name, start ms from the call's start, ms], the 20 longest (host lines) or
    the last 12 (GPU lines)."""
    from jax._src.lib import _profile_data  # noqa: PLC0415 - private: reads the XSpace

    planes = list(_profile_data.ProfileData.from_file(path).planes)
    calls = [e for p in planes for line in p.lines for e in line.events if e.name == call_name]
    if not calls:
        return {}
    call = min(calls, key=lambda e: e.start_ns)
    end = call.start_ns + call.duration_ns
    out = {}
    for plane in planes:
        for line in plane.lines:
            events = [e for e in line.events if e.start_ns >= end and not e.name.startswith("$")]
            if not events:
                continue
            gpu = "/device:GPU" in plane.name
            events.sort(key=(lambda e: e.start_ns) if gpu else (lambda e: -e.duration_ns))
            out[f"{plane.name} | {line.name}"] = [
                [e.name[:60], round((e.start_ns - call.start_ns) / 1e6, 4), e.duration_ns / 1e6]
                for e in (events[-12:] if gpu else events[:20])
            ]
    return out


def _traced_admission(engine: Engine, prompt: list[int]) -> dict:
    """One admission (`_admit`) under `jax.profiler`: its launch-to-read time, the step call's
    duration, the host's events inside the call summed by name (`probes.host_trace._inside`),
    each GPU line's first kernel from the call's start with its busy time and gaps, and the
    events after the call (`_after_call`: the read's copies and callbacks)."""
    from probes.host_trace import _lines  # noqa: PLC0415 - imports the profiler's reader

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            step_s = _admit(engine, prompt)[0]
        [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        lines = _lines(path, "PjitFunction(step)")
        after = _after_call(path, "PjitFunction(step)")
    hosts = [line for line in lines.values() if "calls" in line]
    starts = [host["first_ns"] + 1e6 * call[0] for host in hosts for call in host["calls"]]
    gpu = {  # each GPU line's kernels: from the call's start (ms), busy time and the gaps
        name: dict(
            first_ms=(line["first_ns"] - min(starts)) / 1e6 if starts else None,
            span_ms=line["span_ms"],
            busy_ms=line["busy_ms"],
            gap_ms=line["gap_ms"],
            largest_gaps_us_at_ms=line["largest_gaps_us_at_ms"][:6],
        )
        for name, line in lines.items()
        if "gap_ms" in line
    }
    return dict(
        traced_step_ms=1e3 * step_s,
        traced_calls_ms=[call[1] for host in hosts for call in host["calls"]],
        after_call=after,
        inside_call=[host["inside_calls"][0][:25] for host in hosts],
        gpu_lines=gpu,
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b")
    parser.add_argument("--graphs-up-to", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--max-seqs", type=int, default=16)
    parser.add_argument("--running", type=int, default=15)
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--profile", action="store_true", help="then one CUPTI pass a case")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="then one admission a case under jax.profiler: the host's events inside the "
        "step's call, the GPU's kernels from the call's start, the events after the call "
        "(`_traced_admission`; set XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true "
        "to keep command buffers)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    new_tokens = 8 * args.ctx  # the running rows outlast the probe
    config = roomy_engine_config(
        page_size=16, budget=args.budget, max_seqs=args.max_seqs, max_len=args.ctx + new_tokens
    )
    engines = {}
    for graphs in args.graphs_up_to:
        start = time.perf_counter()
        engines[graphs] = engine = Engine(
            model,
            config,
            xla_options=lambda n, g=graphs, **kind: step_xla_options(n, **kind, graphs_up_to=g),
        )
        print(f"graphs up to {graphs}: built in {time.perf_counter() - start:.1f} s", flush=True)
        for _ in range(args.running):
            prompt = rng.integers(0, vocab, args.ctx).tolist()
            engine.add_request(prompt, SamplingParams(new_tokens))
        while len(engine.scheduler.running) < args.running or engine.scheduler.waiting:
            engine.step()
    sizes = config.step_token_counts

    def admission(size):
        return rng.integers(0, vocab, size - args.max_seqs).tolist()

    for engine in engines.values():  # warm-up: every size once after the last compile
        for size in sizes:
            for _ in range(2):
                _admit(engine, admission(size))
    times = {(g, n): [] for g in engines for n in sizes}
    for _ in range(args.reps):
        for graphs, engine in engines.items():
            for size in sizes:
                # A block between admissions, as in serving.
                engine.step()
                times[graphs, size].append(_admit(engine, admission(size)))
    gpu = {}
    if args.profile:  # last: nothing timed after it
        _discard_first_capture()
        for graphs, engine in engines.items():
            for size in sizes:
                engine.step()
                gpu[graphs, size] = _admit(engine, admission(size), profile=True)[2:]
    traces = {}
    if args.trace:  # a trace slows its process afterwards: last of all
        for graphs, engine in engines.items():
            for size in sizes:
                engine.step()
                traces[graphs, size] = _traced_admission(engine, admission(size))
    cases = []
    for (graphs, size), pairs in times.items():
        wall, dispatch = 1e3 * np.array(pairs).T
        case = dict(graphs_up_to=graphs, tokens=size, running=args.running, ctx=args.ctx)
        case |= dict(
            step_ms=float(np.median(wall)),
            step_ms_min=float(wall.min()),
            step_ms_max=float(wall.max()),
            dispatch_ms=float(np.median(dispatch)),
        )
        if (graphs, size) in gpu:
            case |= dict(gpu_ms=gpu[graphs, size][0], kernels=gpu[graphs, size][1])
        if (graphs, size) in traces:
            case |= traces[graphs, size]
        cases.append(case)
        print(json.dumps(case), flush=True)
    result = dict(environment(), probe="mixed_step", config=args.config, cases=cases)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
