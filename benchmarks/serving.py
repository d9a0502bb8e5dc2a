"""Serving on the H200 (issue 20, item 3): requests that arrive while others decode.

    python -m benchmarks.serving --out benchmarks/results/h200_serving.json [--smoke]

A steady stream: `--requests` requests of `--prompt-len` random tokens, each asking for
`--new-tokens` greedy tokens, arrive one every `--interval-ms` (the first at 0) at an engine of
`--max-seqs` slots whose pool holds every slot at its longest (nothing waits for pages). The
host loop admits each request once its arrival time has passed and steps the engine while it
has work, as a server's loop would; it sleeps only when the engine is idle. One case per
interval and `--modes` entry; an interval of 0 is a burst, every request at once (the
engine's most tokens/s on this workload, its slots always full while requests wait). The
modes are the loop's `Engine.step` calls: `poll` (`wait=False`: a call returns at once while
the decode block in flight runs, and the loop polls), `wait` (each call that meets a block in
flight enqueues the next one and waits for the first):

- `ttft_*_ms`: a request's time to first token, from its arrival to the host holding its first
  token (mean, median, 90th percentile, most). A request that arrives while a decode block
  runs waits for that block (`Engine._next_block` enqueues no block after it while requests
  wait; in `wait` mode, for the block enqueued behind it too), then for the mixed step that
  prefills its prompt and samples its first token.
- `tpot_ms`: time per output token after the first, the mean over requests of (last token -
  first token) / (tokens - 1).
- `output_tokens_per_s`: every generated token over the wall time from the first arrival to
  the last token.
- `mean_decode_rows`: the rows of a block's decode steps, on average; `block_ms`: the mean
  time from a block's launch to its read; `mixed_step_ms`: the same for the mixed steps (the
  prompts' chunks with the running rows' decode tokens), from the later of its launch and the
  read before it; `blocks_after_steps`: the blocks enqueued behind a mixed step before its
  read (`Engine._block_may_follow`).

The same engine serves an untimed stream of the same kind twice first: every call kind
compiles, and a compile evicts every other executable's CUDA graphs (benchmarks/NOTES.md runs
207-208), so the second stream runs each kind once after the last compile.
`--smoke` runs the tiny config on small sizes (any machine) to check the script itself.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from flax import nnx

import jaxpaged
from benchmarks.common import print_table, roomy_engine_config, write_results
from models.config import CONFIGS, EngineConfig
from models.decoder import Decoder
from models.engine import Engine, Stats, step_xla_options
from models.scheduler import SamplingParams


def _config(args) -> EngineConfig:
    return roomy_engine_config(
        page_size=args.page_size,
        budget=args.budget,
        max_seqs=args.max_seqs,
        max_len=args.prompt_len + args.new_tokens,
        mixed_step_tokens=None if args.mixed_step_tokens is None else tuple(args.mixed_step_tokens),
    )


def serve(
    engine: Engine, prompts, params: SamplingParams, interval_s: float, *, poll: bool = True
) -> dict:
    """Serve `prompts` arriving one every `interval_s`, stepping the engine with `wait=not
    poll`; returns the timings (the module's docstring) and `outputs`, each request's tokens."""
    arrivals = [i * interval_s for i in range(len(prompts))]
    seqs, first, last = [], {}, {}
    start = time.perf_counter()
    while len(seqs) < len(prompts) or engine.has_work():
        now = time.perf_counter() - start
        while len(seqs) < len(prompts) and arrivals[len(seqs)] <= now:
            seqs.append(engine.add_request(prompts[len(seqs)], params))
        if not engine.has_work():
            time.sleep(arrivals[len(seqs)] - now)
            continue
        steps = engine.stats.steps
        engine.step(wait=not poll)
        if engine.stats.steps == steps:  # a poll of a block in flight, or a step left in flight
            continue
        now = time.perf_counter() - start
        for i, seq in enumerate(seqs):
            if seq.output and i not in first:
                first[i] = now
            if seq.finished and i not in last:
                last[i] = now
    seconds = time.perf_counter() - start
    ttft = 1e3 * np.array([first[i] - arrivals[i] for i in range(len(seqs))])
    tpot = [
        1e3 * (last[i] - first[i]) / (len(seq.output) - 1)
        for i, seq in enumerate(seqs)
        if len(seq.output) > 1
    ]
    stats = engine.stats
    return dict(
        ttft_mean_ms=ttft.mean(),
        ttft_p50_ms=np.median(ttft),
        ttft_p90_ms=np.percentile(ttft, 90),
        ttft_max_ms=ttft.max(),
        tpot_ms=float(np.mean(tpot)),
        output_tokens_per_s=sum(len(s.output) for s in seqs) / seconds,
        wall_ms=1e3 * seconds,
        mean_decode_rows=stats.decode_tokens / max(stats.decode_steps, 1),
        block_ms=1e3 * stats.decode_time / max(stats.blocks, 1),
        blocks=stats.blocks,
        mixed_steps=stats.prefill_steps,
        mixed_step_ms=1e3 * stats.prefill_time / max(stats.prefill_steps, 1),
        blocks_after_steps=stats.blocks_after_steps,
        outputs=[s.output for s in seqs],
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b", choices=sorted(CONFIGS))
    parser.add_argument("--implementation", default=None)
    sizes = dict(page_size=16, budget=2048, max_seqs=16, prompt_len=1024, new_tokens=128)
    for name, default in (sizes | dict(requests=64)).items():  # budget: a step's tokens
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--interval-ms", type=float, nargs="*", default=[40.0, 20.0, 12.5, 0.0])
    parser.add_argument("--modes", nargs="+", default=["poll"], choices=["poll", "wait"])
    parser.add_argument(
        "--mixed-step-tokens", type=int, nargs="*", default=None, help="none: the budget only"
    )
    parser.add_argument(
        "--graphs-up-to",
        type=int,
        default=None,
        help="steps of at most this many tokens run in command buffers (default: the engine's "
        "rule, `step_xla_options`)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny config, small sizes")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.max_seqs, args.prompt_len, args.new_tokens = "tiny", 4, 40, 12
        args.budget, args.requests, args.interval_ms = 64, 8, [5.0]

    model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    implementation = "/".join(
        jaxpaged.resolve_implementation(op, args.implementation, model.config.dtype)
        for op in ("ragged", "decode")
    )
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(args.new_tokens)
    start = time.perf_counter()
    engine = Engine(
        model,
        _config(args),
        implementation=args.implementation,
        xla_options=lambda n, **kind: step_xla_options(n, **kind, graphs_up_to=args.graphs_up_to),
    )
    counts = engine.config.step_token_counts
    print(f"engine built in {time.perf_counter() - start:.1f} s (mixed steps of {counts} tokens)")
    warm = rng.integers(0, vocab, (min(args.requests, 2 * args.max_seqs), args.prompt_len))
    for _ in range(2):
        serve(engine, warm.tolist(), params, min(args.interval_ms) / 1e3)
    cases = []
    for mode, interval_ms in itertools.product(args.modes, args.interval_ms):
        prompts = rng.integers(0, vocab, (args.requests, args.prompt_len)).tolist()
        engine.stats = Stats()
        case = dict(kind="serving", mode=mode, interval_ms=interval_ms, requests=args.requests)
        case |= dict(prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        case |= dict(max_seqs=args.max_seqs, decode_steps=engine.config.decode_steps)
        case |= dict(mixed_step_tokens=list(counts), graphs_up_to=args.graphs_up_to)
        timed = serve(engine, prompts, params, interval_ms / 1e3, poll=mode == "poll")
        outputs = timed.pop("outputs")
        case |= timed
        if any(len(out) != args.new_tokens for out in outputs):
            raise RuntimeError("a request stopped short of --new-tokens")
        cases.append(case | dict(config=args.config, implementation=implementation))
        print_table([case], [k for k in case if k not in ("kind", "requests")])
        if args.out:
            write_results(args.out, "serving", cases)
    return cases


if __name__ == "__main__":
    main()
