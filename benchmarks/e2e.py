"""End to end on the H200: the ~1B decoder's prefill and decode through the engine, against the
same weights run densely (contiguous KV, XLA attention).

    python -m benchmarks.e2e --out benchmarks/results/e2e_h200.json

Prefill: one prompt of `--prompt-len` tokens, single-shot (one step) and in chunks of 256, 512
and 2048 tokens; tokens/s is the prompt length over the wall time of its steps, the median of
`--repeats` runs (`tokens_per_s_range`: the slowest and fastest). Decode:
batches of 1, 16 and 64 sequences with `--ctx` cached tokens each decode greedily, all rows
together; tokens/s counts the tokens of `--new-tokens` - 1 decode steps of the whole batch over
the engine wall time from the first decode launch to the sync of the last block (decode
blocks, host syncs and scheduling included; `_decode_part`), after an untimed window of
other prompts of the same length; `steady_tokens_per_s` leaves out the first block (its
launch, with the GPU idle), as the HF anchor's difference of two lengths does. Each
decode row also gives the block length in ms (how long a request added between `Engine.step`
calls waits at most for its mixed step; `benchmarks.serving` times requests that arrive while
the host waits for a block: up to two blocks), the HBM floor (`_step_bytes` over
`_copy_bandwidth`) and, with `--hf`, Hugging Face transformers with a static cache and
torch.compile (`benchmarks.hf_anchor`, run first in a subprocess). The dense baseline runs
the same weights with a contiguous KV cache and `jax.nn.dot_product_attention(
implementation="xla")`, one jitted call per prefill or decode step with one sync per step; its
single-shot prefill logits are compared with the engine's so that the baseline is known to be
the same model.

Batch prefill (`--batch-prompts N`, default 16): N prompts of `--prompt-len` tokens prefilled
together with the step's token budget held at `--prompt-len`, as a server runs many requests.
Single-shot takes one whole prompt per step; chunks of c tokens put `prompt_len // c` sequences'
chunks into each step. Every step then has the same matmul shapes, so the ratio shows what
chunking itself costs: attention of chunks over cached prefixes, and the scheduling.

`--profile` adds each case's GPU time per step from CUPTI (the steps run once more), split into
matmuls, attention and the rest, and the kernels per step: what the wall time spends beyond
kernels is launch gaps and host work. (The first CUPTI capture of a process has been seen to
miss most kernels, so one is run and thrown away first: see `benchmarks/NOTES.md`.)

`--decode-variants plain layer layer-1slot phases phases-1slot` runs each decode batch of at
most 8 rows once per variant, beside the same anchors: the step's own XLA layers
(`--no-layer-kernel`), the layer kernel path (`Decoder(layer_kernel=True)`) as the persistent
kernel in at least two sequence slots, and that path with one slot at B=1
(`models.engine.LAYER_PATH_MIN_DECODE_ROWS`, the engine's default: the step's only dot left to
XLA is then the logits); `phases` the same with one kernel a phase (`Decoder.layer_form`).

`--model PATH` runs a Hugging Face checkpoint (`models.checkpoint.load_pretrained`) instead of
a built-in config, and the HF anchor then loads the same folder.

`--smoke` runs the tiny config on small sizes (any machine) to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpaged
from benchmarks.common import print_table, roomy_engine_config, write_results
from models import engine as engine_module
from models.checkpoint import load_pretrained
from models.config import CONFIGS, EngineConfig
from models.decoder import LAYER_KERNEL_MAX_ROWS, Decoder
from models.engine import Engine, Stats, compiler_options, step_xla_options
from models.scheduler import SamplingParams

# `--decode-variants`: name -> (`Decoder.layer_kernel`, the fewest slots of a decode step
# through the layer path, `models.engine.LAYER_PATH_MIN_DECODE_ROWS`, `Decoder.layer_form`).
DECODE_VARIANTS = {
    "plain": (False, None, None),
    "layer": (True, 2, "persistent"),
    "layer-1slot": (True, 1, "persistent"),
    "phases": (True, 2, "phases"),
    "phases-1slot": (True, 1, "phases"),
}
DEFAULT_MIN_DECODE_ROWS = engine_module.MIN_DECODE_ROWS
DEFAULT_LAYER_PATH_ROWS = engine_module.LAYER_PATH_MIN_DECODE_ROWS


def _engine(
    model, implementation, *, max_seqs, budget, max_len, page_size, xla_options, chunk=None
) -> Engine:
    # Mixed steps at the budget only: the timed steps fill it (whole prompts or chunks of
    # them) or are decode blocks, so smaller sizes would be compiles (~13 s each on the H200)
    # that no timed step takes.
    config = roomy_engine_config(
        page_size=page_size,
        budget=budget,
        max_seqs=max_seqs,
        max_len=max_len,
        chunk=chunk,
        mixed_step_tokens=(),
    )
    return Engine(model, config, implementation=implementation, xla_options=xla_options)


def _timed(engine: Engine, prompts, params: SamplingParams, repeats: int) -> list[Stats]:
    """Compile on one untimed run of the same prompts, then time `repeats` more; returns their
    stats, fastest prefill first (the host time of chunked steps moves by a millisecond from
    run to run: benchmarks/NOTES.md, session 11). A short warm-up prompt (two tokens, before
    session 14) compiled no step of prompt chunks that samples nothing, whose kind then
    compiled inside the first timed run of every chunked case."""
    engine.generate(prompts, params)
    runs = []
    for _ in range(repeats):
        engine.stats = Stats()
        engine.generate(prompts, params)
        runs.append(engine.stats)
    return sorted(runs, key=lambda stats: stats.prefill_time)


_KERNEL_KINDS = (
    ("matmul", re.compile(r"gemm|xmma|cutlass|matmul|cublas|nvjet", re.I)),
    ("attention", re.compile(r"prefill|decode|attention|body", re.I)),
)


def _kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in _KERNEL_KINDS if pattern.search(name)), "other")


def _profiled(engine: Engine, prompts, params: SamplingParams) -> dict:
    """GPU time of the engine's steps on `prompts`: every kernel CUPTI sees while the (already
    compiled) engine runs them once more, per step, split into matmuls, attention and the rest.
    Uses the CUPTI hooks behind `jax.experimental.mosaic.gpu.profiler.measure` (private), so
    that the steps are the engine's own donated calls."""
    from jax._src.lib import mosaic_gpu  # noqa: PLC0415 - private, GPU only

    ext = mosaic_gpu._mosaic_gpu_ext
    steps = engine.stats.steps
    ext._cupti_init()
    try:
        engine.generate(prompts, params)
    finally:
        timings = ext._cupti_get_timings(True)
    return _kernel_summary(timings, engine.stats.steps - steps)


def _discard_first_capture() -> None:
    """Run and throw away one CUPTI capture: the first of a process has been seen to miss most
    kernels (benchmarks/NOTES.md)."""
    from jax._src.lib import mosaic_gpu  # noqa: PLC0415 - private, GPU only

    mosaic_gpu._mosaic_gpu_ext._cupti_init()
    jax.block_until_ready(jnp.ones((1024, 1024)) @ jnp.ones((1024, 1024)))
    mosaic_gpu._mosaic_gpu_ext._cupti_get_timings(True)


def _prefill_case(engine: Engine, prompts, kind: str, chunk: int, args) -> dict:
    """Prefill of `prompts` (one token generated, so every step is a prefill step)."""
    params = SamplingParams(max_new_tokens=1)
    runs = _timed(engine, prompts, params, args.repeats)
    stats = runs[len(runs) // 2]  # the median run
    case = dict(
        kind=kind,
        prompts=len(prompts),
        tokens=args.prompt_len,
        chunk="single-shot" if chunk == args.prompt_len else chunk,
        steps=stats.steps,
        tokens_per_s=stats.prefill_tokens_per_s,
        wall_ms_per_step=1e3 * stats.prefill_time / stats.prefill_steps,
        dispatch_ms_per_step=1e3 * stats.dispatch_time / stats.steps,
        repeats=len(runs),
        tokens_per_s_range=[runs[-1].prefill_tokens_per_s, runs[0].prefill_tokens_per_s],
    )
    if args.profile:
        case.update(_profiled(engine, prompts, params))
    return case


def _dense_layer(layer, x, k_cache, v_cache, positions, kv_lens, *, prefill: bool):
    """One decoder layer on x [B, T, hidden] with a contiguous cache [B, max_len, Hkv, D]."""
    attn = layer.attn
    batch, num_tokens, hidden = x.shape
    h = layer.input_norm(x).reshape(batch * num_tokens, hidden)
    q, k, v = attn.project(h, positions.reshape(-1))
    q = q.reshape(batch, num_tokens, -1, attn.head_dim)
    k, v = (a.reshape(batch, num_tokens, -1, attn.head_dim) for a in (k, v))
    rows = jnp.arange(batch)[:, None]
    k_cache = k_cache.at[rows, positions].set(k)
    v_cache = v_cache.at[rows, positions].set(v)
    if prefill:  # q_len == kv_len: the top-left causal mask is the right one
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    else:
        out = jax.nn.dot_product_attention(
            q, k_cache, v_cache, key_value_seq_lengths=kv_lens, implementation="xla"
        )
    x = x + attn.o_proj(out.reshape(batch, num_tokens, -1))
    return x + layer.mlp(layer.post_attention_norm(x)), k_cache, v_cache


def _dense_step(graphdef, params, caches, tokens, start, *, prefill):
    """tokens i32[B, T] at positions start[b] + i; returns next tokens, last logits, caches."""
    model = nnx.merge(graphdef, params)
    positions = start[:, None] + jnp.arange(tokens.shape[1])
    x = model.embed(tokens)
    new_caches = []
    for layer, (k_cache, v_cache) in zip(model.layers, caches, strict=True):
        x, k_cache, v_cache = _dense_layer(
            layer, x, k_cache, v_cache, positions, start + tokens.shape[1], prefill=prefill
        )
        new_caches.append((k_cache, v_cache))
    logits = model.logits(model.norm(x[:, -1]))
    return jnp.argmax(logits, -1).astype(jnp.int32), logits, new_caches


@functools.cache
def _dense_step_fn(graphdef, num_tokens: int, decode: bool = False):
    """`_dense_step` jitted with `graphdef` bound (as the engine binds its step's): a static
    GraphDef would be hashed on every call, milliseconds of host time per step. It gets the
    XLA options of an engine step of `num_tokens` tokens, so that the two differ only in their
    KV cache and attention."""
    return jax.jit(
        functools.partial(_dense_step, graphdef),
        static_argnames="prefill",
        donate_argnames="caches",
        compiler_options=compiler_options(step_xla_options(num_tokens, decode=decode)),
    )


def _dense_caches(config, batch: int, max_len: int):
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    return [
        (jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))
        for _ in range(config.num_layers)
    ]


def _dense_prefill(model, prompts: np.ndarray, max_len: int):
    """Single-shot prefill of prompts [B, L]: (seconds, last logits, caches, next tokens)."""
    graphdef, params = nnx.split(model)
    start = jnp.zeros(prompts.shape[0], jnp.int32)
    run = functools.partial(
        _dense_step_fn(graphdef, prompts.size),
        params,
        tokens=jnp.asarray(prompts),
        start=start,
        prefill=True,
    )
    jax.block_until_ready(run(_dense_caches(model.config, prompts.shape[0], max_len)))
    caches = _dense_caches(model.config, prompts.shape[0], max_len)
    t0 = time.perf_counter()
    tokens, logits, caches = run(caches)
    tokens = np.asarray(tokens)
    return time.perf_counter() - t0, np.asarray(logits), caches, tokens


def _dense_decode_tokens_per_s(model, prompts: np.ndarray, max_len: int, new_tokens: int):
    graphdef, params = nnx.split(model)
    _, _, caches, tokens = _dense_prefill(model, prompts, max_len)
    start = np.full(prompts.shape[0], prompts.shape[1], np.int32)
    step = _dense_step_fn(graphdef, prompts.shape[0], True)  # once: the lookup hashes the GraphDef
    times = []
    for i in range(new_tokens):
        t0 = time.perf_counter()
        tokens, _, caches = step(
            params,
            caches,
            jnp.asarray(tokens)[:, None],
            jnp.asarray(start + i),
            prefill=False,
        )
        tokens = np.asarray(tokens)  # the one sync per step
        times.append(time.perf_counter() - t0)
    steady = times[1:]  # the first step compiles
    return prompts.shape[0] * len(steady) / sum(steady)


def _decode_budget(num_prompts: int, ctx: int, steps: int, budget: int) -> int:
    """`max_new_tokens` for `_decode_part` of `num_prompts` prompts of `ctx` tokens through
    steps of `budget` tokens: the `steps` timed, two blocks past them, and the tokens a row may
    decode before the last prompt's prefill ends (at most one a mixed step: the prompts'
    tokens over the budget, plus a step per prompt)."""
    before = -(-num_prompts * ctx // budget) + num_prompts
    return steps + 2 * (EngineConfig.decode_steps or 1) + before


def _decode_part(engine: Engine, prompts, steps: int, profile: bool = False, top: int = 12) -> dict:
    """Prefill `prompts`, then time about `steps` decode steps of the whole batch: engine wall
    time from the first decode launch to the sync of the block that completes them. Rows that
    finished their prompts first decoded a few tokens in the mixed steps since, so rows end
    at different steps; every row gets `_decode_budget` tokens, more than it spends in the
    window, and the generation runs out untimed after it. (Before session 14 the window ran
    to the last row's end, and the batch thinned out over its last steps: B=64 then counted
    56 tokens a step.) With `profile`, also the window's CUPTI kernels per decode step."""
    config = engine.config
    budget = _decode_budget(len(prompts), len(prompts[0]), steps, config.max_tokens_per_step)
    if config.decode_steps != EngineConfig.decode_steps or budget + len(prompts[0]) >= (
        config.max_model_len
    ):
        raise ValueError("the engine's blocks or max_model_len do not fit _decode_budget")
    params = SamplingParams(max_new_tokens=budget)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(s.num_cached < s.prompt_len for s in seqs):
        engine.step()
    engine.sync()
    stats = dataclasses.replace(engine.stats)
    lengths = sum(len(s.tokens) for s in seqs)
    if profile:
        from jax._src.lib import mosaic_gpu  # noqa: PLC0415 - private, GPU only

        mosaic_gpu._mosaic_gpu_ext._cupti_init()
    start = time.perf_counter()
    ends = []  # (time, decode steps so far) as each block is read
    while engine.stats.decode_steps - stats.decode_steps < steps:
        blocks = engine.stats.blocks
        engine.step()
        if engine.stats.blocks != blocks:
            ends.append((time.perf_counter(), engine.stats.decode_steps))
    engine.sync()
    seconds = time.perf_counter() - start
    if ends and engine.stats.decode_steps != ends[-1][1]:
        ends.append((start + seconds, engine.stats.decode_steps))
    if profile:
        timings = mosaic_gpu._mosaic_gpu_ext._cupti_get_timings(True)
    steps = engine.stats.decode_steps - stats.decode_steps
    tokens = engine.stats.decode_tokens - stats.decode_tokens
    dispatch = engine.stats.dispatch_time - stats.dispatch_time  # the window's, not the tail's
    # The rows' mean KV length over the window (a row's cached tokens when it decodes one).
    mean_kv_len = (2 * lengths + tokens) / (2 * len(prompts))
    if tokens != len(prompts) * steps:
        raise RuntimeError(f"a row left the timed window: {tokens} tokens in {steps} steps")
    while engine.has_work():
        engine.step()
    result = dict(
        steps=steps,
        mean_kv_len=mean_kv_len,
        tokens_per_s=tokens / seconds,
        wall_ms_per_step=1e3 * seconds / steps,
        dispatch_ms_per_step=1e3 * dispatch / steps,
    )
    # Steady state: from the first block's end to the last's, the blocks after the first. Each
    # was enqueued while the one before ran, so this leaves out only the first block's launch
    # (~2.5-3.5 ms of host time with the GPU idle, benchmarks/NOTES.md runs 207-209), as
    # the HF anchor's difference of two generation lengths leaves out its fixed costs.
    if len(ends) > 1:
        (first, first_steps), (last, last_steps) = ends[0], ends[-1]
        result["steady_ms_per_step"] = 1e3 * (last - first) / (last_steps - first_steps)
        result["steady_tokens_per_s"] = len(prompts) / (result["steady_ms_per_step"] / 1e3)
    if profile:
        result.update(_kernel_summary(timings, steps, top))
    return result


def _kernel_summary(timings, steps: int, top: int = 12) -> dict:
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, ms in timings:
        by_kind[_kernel_kind(name)] = by_kind.get(_kernel_kind(name), 0.0) + ms
        by_name.setdefault(name, []).append(ms)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return dict(
        gpu_ms_per_step=sum(by_kind.values()) / steps,
        gpu_ms_per_step_by_kind={k: v / steps for k, v in sorted(by_kind.items())},
        kernels_per_step=len(timings) / steps,
        top_kernels_ms_per_step=[(name[:60], sum(ms) / steps, len(ms) / steps) for name, ms in top],
    )


def _step_bytes(config, batch: int, ctx: int) -> int:
    """The bytes a decode step must read: every weight once except the embedding table's
    unused rows (the vocabulary projection, tied or not, is read whole) and each sequence's
    cached K and V."""
    weights = config.num_params() - config.vocab_size * config.hidden_size * (
        not config.tie_word_embeddings
    )
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim
    itemsize = jnp.dtype(config.dtype).itemsize
    return itemsize * (weights + batch * ctx * kv_per_token)


def _copy_bandwidth() -> float:
    """TB/s of an XLA copy of 4 GiB (bytes read + written over the CUPTI-free wall time of
    ten copies): the HBM rate the floor is computed at."""
    x = jnp.ones((2**31,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + 1)
    jax.block_until_ready(copy(x))
    start = time.perf_counter()
    for _ in range(10):
        y = copy(x)
    jax.block_until_ready(y)
    seconds = (time.perf_counter() - start) / 10
    return 2 * x.nbytes / seconds / 1e12


def _hf_anchor(args) -> dict | None:
    """`benchmarks.hf_anchor` in a subprocess, before this process touches the GPU."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    cmd = [sys.executable, "-m", "benchmarks.hf_anchor", "--ctx", str(args.ctx)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--batches"]
    done = subprocess.run(cmd + [str(b) for b in args.batches], capture_output=True, text=True)
    if done.returncode:
        print(f"HF anchor failed: {done.stderr[-2000:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _xla_option(text: str) -> tuple[str, object]:
    """ "NAME=VALUE" -> (name, value), VALUE read as a bool, an int or else a string."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("xla_"):
        raise SystemExit(f"--xla-option takes NAME=VALUE with an xla_ NAME; got {text!r}")
    parsed = {"true": True, "false": False}.get(value.lower(), value)
    return name, int(value) if value.lstrip("-").isdigit() else parsed


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1b", choices=sorted(CONFIGS))
    parser.add_argument("--model", default=None, help="a Hugging Face model folder instead")
    parser.add_argument("--implementation", default=None)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="*", default=[256, 512, 2048])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, default=1024, help="cached tokens per decode sequence")
    parser.add_argument("--new-tokens", type=int, default=129)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch-prompts", type=int, default=16, help="0: no batch prefill")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each prefill case (the median)"
    )
    parser.add_argument("--profile", action="store_true", help="CUPTI GPU time per step")
    parser.add_argument(
        "--layer-kernel",
        action="store_const",
        const=True,
        default=None,
        help="decode steps of at most 8 rows run `Decoder(layer_kernel=True)`'s path (the "
        "default: where its kernels run)",
    )
    parser.add_argument(
        "--no-layer-kernel",
        dest="layer_kernel",
        action="store_const",
        const=False,
        help="decode steps run the step's own XLA layers",
    )
    parser.add_argument(
        "--min-decode-rows",
        type=int,
        default=None,
        help="the fewest sequence slots of a decode step (models.engine.MIN_DECODE_ROWS)",
    )
    parser.add_argument(
        "--decode-variants",
        nargs="*",
        choices=sorted(DECODE_VARIANTS),
        default=None,
        help="decode batches of at most 8 rows run once in each (the model's path and the "
        "fewest slots), beside the same anchors; larger batches once as the flags say",
    )
    parser.add_argument(
        "--top-kernels", type=int, default=12, help="with --profile: the costliest kernels listed"
    )
    parser.add_argument(
        "--xla-defaults",
        action="store_true",
        help="compile the engine's steps with XLA's default options, not step_xla_options",
    )
    parser.add_argument(
        "--xla-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an XLA option added to step_xla_options for every step (repeatable)",
    )
    parser.add_argument(
        "--decode-xla-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an XLA option added for decode steps and blocks only (repeatable)",
    )
    parser.add_argument(
        "--split-k-max-tokens",
        type=int,
        default=None,
        help="steps of at most this many tokens split qkv and gate/up over K "
        "(jaxpaged.layers.DECODE_SPLIT_K_MAX_TOKENS; 0: none)",
    )
    parser.add_argument(
        "--output-split-k-max-tokens",
        type=int,
        default=None,
        help="steps of at most this many tokens split o and down over K, summed in "
        "add_rms_norm (jaxpaged.layers.DECODE_OUTPUT_SPLIT_K_MAX_TOKENS; 0: none)",
    )
    parser.add_argument(
        "--output-split-k",
        type=int,
        default=None,
        help="the parts of that split (jaxpaged.layers.DECODE_OUTPUT_SPLIT_K)",
    )
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--hf", action="store_true", help="time the HF transformers anchor")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny config, small sizes")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.config, args.prompt_len, args.chunks, args.batches = "tiny", 96, [16, 32], [1, 4]
        args.ctx, args.new_tokens, args.batch_prompts = 40, 6, min(args.batch_prompts, 4)

    if args.split_k_max_tokens is not None:
        jaxpaged.layers.DECODE_SPLIT_K_MAX_TOKENS = args.split_k_max_tokens
    if args.output_split_k_max_tokens is not None:
        jaxpaged.layers.DECODE_OUTPUT_SPLIT_K_MAX_TOKENS = args.output_split_k_max_tokens
    if args.output_split_k is not None:
        jaxpaged.layers.DECODE_OUTPUT_SPLIT_K = args.output_split_k
    if args.min_decode_rows is not None:
        engine_module.MIN_DECODE_ROWS = args.min_decode_rows
    hf = _hf_anchor(args) if args.hf else None  # first: torch needs the GPU's memory
    if args.profile and jax.default_backend() == "gpu":
        _discard_first_capture()
    if args.model:
        model, _ = load_pretrained(args.model)
        args.config = args.model.rstrip("/").rsplit("/", 1)[-1]
        if model.config.sliding_window and not args.no_baseline:
            print("no dense baseline: it has no sliding window")
            args.no_baseline = True
    else:
        model = Decoder(CONFIGS[args.config], rngs=nnx.Rngs(0))
    model_layer_kernel = model.layer_kernel if args.layer_kernel is None else args.layer_kernel
    model_layer_form = model.layer_form
    model.layer_kernel = model_layer_kernel
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    extra = tuple(_xla_option(text) for text in args.xla_option)
    decode_extra = tuple(_xla_option(text) for text in args.decode_xla_option)
    xla_options = () if args.xla_defaults else None
    if extra or decode_extra:
        base = (lambda n, **kind: ()) if args.xla_defaults else step_xla_options

        def xla_options(num_tokens, *, decode, prompt_only):
            kind_options = base(num_tokens, decode=decode, prompt_only=prompt_only)
            return kind_options + extra + (decode_extra if decode else ())

    make = functools.partial(
        _engine, model, args.implementation, page_size=args.page_size, xla_options=xla_options
    )
    cases = []

    def record(case: dict) -> None:
        """Keep, print and (with --out) write a case: a run cut short keeps what it measured."""
        cases.append(case)
        print_table([case], [k for k in case if not isinstance(case[k], dict | list)])
        if args.out:
            write_results(args.out, "e2e", cases)

    prompt = rng.integers(0, vocab, args.prompt_len).tolist()
    max_len = args.prompt_len + 1
    for chunk in [] if args.skip_prefill else [args.prompt_len, *args.chunks]:
        engine = make(max_seqs=1, budget=chunk, max_len=max_len)
        case = _prefill_case(engine, [prompt], "prefill", chunk, args)
        if chunk == args.prompt_len and not args.no_baseline:
            [seq] = engine.generate(
                [prompt], SamplingParams(max_new_tokens=1), record_prompt_logits=True
            )
            seconds, logits, _, _ = _dense_prefill(model, np.asarray(prompt)[None], max_len)
            case["baseline_tokens_per_s"] = args.prompt_len / seconds
            case["baseline_max_abs_logit_diff"] = float(
                np.max(np.abs(logits[0] - seq.prompt_logits[-1]))
            )
        record(case)

    if args.batch_prompts and not args.skip_prefill:
        prompts = rng.integers(0, vocab, (args.batch_prompts, args.prompt_len)).tolist()
        for chunk in [args.prompt_len, *args.chunks]:
            engine = make(
                max_seqs=args.batch_prompts, budget=args.prompt_len, max_len=max_len, chunk=chunk
            )
            record(_prefill_case(engine, prompts, "batch_prefill", chunk, args))

    copy_tb_s = _copy_bandwidth() if jax.default_backend() == "gpu" else None
    variants = args.decode_variants or [None]
    runs = [
        (batch, variant)
        for batch in args.batches
        for variant in (variants if batch <= LAYER_KERNEL_MAX_ROWS else [None])
    ]
    baselines = {}
    for batch, variant in runs:
        prompts = np.random.default_rng([batch, args.ctx]).integers(0, vocab, (batch, args.ctx))
        steps, budget = args.new_tokens - 1, max(2048, args.ctx)  # the first token: prefill's
        max_len = args.ctx + _decode_budget(batch, args.ctx, steps, budget) + 1
        layer_kernel, path_rows, form = DECODE_VARIANTS.get(
            variant, (model_layer_kernel, None, None)
        )
        model.layer_kernel = layer_kernel
        engine_module.LAYER_PATH_MIN_DECODE_ROWS = path_rows or DEFAULT_LAYER_PATH_ROWS
        model.layer_form = form or model_layer_form
        engine = make(max_seqs=batch, budget=budget, max_len=max_len)
        # Compile, and warm up on other prompts of the same length, so that the warm-up runs
        # what the window runs. (Until the engine compiled its pool updates when built, the
        # warm-up's first `release` evicted the block's CUDA graph, and the window's first
        # block call ran op by op, ~20 ms at B=16: benchmarks/NOTES.md, runs 207-208.)
        _decode_part(engine, rng.integers(0, vocab, (batch, args.ctx)).tolist(), steps)
        case = dict(
            kind="decode", batch=batch, ctx=args.ctx, decode_steps=engine.config.decode_steps
        )
        if variant is not None:
            case["variant"] = variant
        case.update(layer_kernel=layer_kernel, decode_rows=engine.decode_rows)
        case["layer_form"] = model.layer_form
        case.update(_decode_part(engine, prompts.tolist(), steps))
        case["block_ms"] = case["wall_ms_per_step"] * engine.config.decode_steps
        if args.profile:
            profiled = _decode_part(
                engine, prompts.tolist(), steps, profile=True, top=args.top_kernels
            )
            case.update({k: v for k, v in profiled.items() if k not in case})
            case["wall_over_gpu"] = case["wall_ms_per_step"] / case["gpu_ms_per_step"]
        floor_bytes = _step_bytes(model.config, batch, round(case["mean_kv_len"]))
        case["floor_bytes_per_step"] = floor_bytes
        if copy_tb_s:
            case["copy_tb_s"] = copy_tb_s
            case["floor_tokens_per_s"] = batch / (floor_bytes / (copy_tb_s * 1e12))
            case["of_floor"] = case["tokens_per_s"] / case["floor_tokens_per_s"]
        if hf:
            [anchor] = [c for c in hf["cases"] if c["batch"] == batch]
            case["hf_tokens_per_s"] = anchor["tokens_per_s"]
            case["vs_hf"] = case["tokens_per_s"] / anchor["tokens_per_s"]
            case["hf_versions"] = f"torch {hf['torch']}, transformers {hf['transformers']}"
        if not args.no_baseline:
            # Its cache as long as the tokens it generates (XLA attention reads all of it);
            # once per batch: it runs no engine, so no variant changes it.
            if batch not in baselines:
                baselines[batch] = _dense_decode_tokens_per_s(
                    model, prompts, args.ctx + args.new_tokens + 1, args.new_tokens
                )
            case["baseline_tokens_per_s"] = baselines[batch]
        if args.min_decode_rows is not None:
            case["min_decode_rows"] = args.min_decode_rows
        record(case)
    model.layer_kernel = model_layer_kernel
    engine_module.LAYER_PATH_MIN_DECODE_ROWS = DEFAULT_LAYER_PATH_ROWS
    engine_module.MIN_DECODE_ROWS = DEFAULT_MIN_DECODE_ROWS
    model.layer_form = model_layer_form

    implementation = {
        op: jaxpaged.resolve_implementation(op, args.implementation, model.config.dtype)
        for op in ("ragged", "decode")
    }
    for case in cases:
        case.update(
            config=args.config,
            xla_options=("xla defaults" if args.xla_defaults else "engine (step_xla_options)")
            + "".join(f", {name}={value}" for name, value in extra)
            + "".join(f", {name}={value} (decode)" for name, value in decode_extra),
            implementation=implementation["ragged" if case["kind"] == "prefill" else "decode"],
        )
        if case["kind"] != "decode":
            case["layer_kernel"] = model_layer_kernel
    if args.out:
        write_results(args.out, "e2e", cases)
    return cases


if __name__ == "__main__":
    main()
