"""The demo, and text generation from a Hugging Face model folder.

    python -m models.generate --config tiny --prompt-len 100 --chunk-size 32 --max-new-tokens 16
    python -m models.generate --model PATH --prompt "..." [--max-new-tokens N] [--temperature T]

The demo builds a seeded random decoder, prefills one random prompt in one step and in chunks,
generates from both, and prints the largest logit difference over all prompt positions, whether
the generated tokens match, prefill and decode throughput and the attention implementation that
ran. With `--model`, the checkpoint's decoder and tokenizer continue `--prompt`, printing the
text as it is generated (a decode block at a time), until the model's EOS ids
(`generation_config.json` / `config.json`) or `--max-new-tokens`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpaged
from models import checkpoint
from models.config import CONFIGS, EngineConfig
from models.decoder import Decoder
from models.engine import Engine, Stats
from models.scheduler import SamplingParams, Sequence


def resolved_implementations(implementation: str | None, dtype) -> dict[str, str]:
    """The backend each attention op runs with `implementation` on this device (for decode,
    the pick for a few sequences: on Hopper a batch of many short ones runs the Triton
    kernel, `jaxpaged.dispatch.TABLE`)."""
    return {
        op: jaxpaged.resolve_implementation(op, implementation, dtype)
        for op in ("ragged", "decode")
    }


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[Sequence, Stats]:
    """Generate with prompt logits recorded, then time a second run of the compiled steps."""
    [recorded] = engine.generate([prompt], params, record_prompt_logits=True)
    engine.generate([prompt[:2]], dataclasses.replace(params, max_new_tokens=2))  # compile
    engine.stats = Stats()
    [timed] = engine.generate([prompt], params)
    assert timed.output == recorded.output
    return recorded, engine.stats


def generate_text(args) -> dict:
    """Continue `args.prompt` with the checkpoint at `args.model`, streaming the text to
    stdout; returns the generated ids, text and finish reason."""
    model, config = checkpoint.load_pretrained(args.model, dtype=args.dtype)
    tokenizer = checkpoint.load_tokenizer(args.model)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens")
    stop = checkpoint.eos_token_ids(args.model)
    max_len = len(ids) + args.max_new_tokens
    engine = Engine(
        model,
        EngineConfig(
            page_size=args.page_size,
            num_pages=-(-max_len // args.page_size),
            max_seqs=1,
            max_tokens_per_step=min(len(ids), 2048),
            max_model_len=max_len,
            max_stop_tokens=max(1, len(stop)),
        ),
        implementation=args.implementation,
    )
    params = SamplingParams(
        args.max_new_tokens, args.temperature, args.seed, args.top_k, args.top_p, stop
    )
    seq = engine.add_request(ids, params)
    stream = not args.json
    if stream:
        print(args.prompt, end="", flush=True)
    start, shown = time.perf_counter(), ""
    while engine.has_work():
        engine.step()
        text = tokenizer.decode(seq.output, skip_special_tokens=True)
        # Hold back a multi-byte character until its last token arrives.
        if stream and text.startswith(shown) and not text.endswith("\ufffd"):
            print(text[len(shown) :], end="", flush=True)
            shown = text
    seconds = time.perf_counter() - start
    result = {
        "model": str(args.model),
        "dtype": jnp.dtype(config.dtype).name,
        "prompt_ids": ids,
        "output_ids": seq.output,
        "text": tokenizer.decode(seq.output, skip_special_tokens=True),
        "finish_reason": seq.finish_reason,
        "seconds": seconds,
    }
    if stream:
        print(shown and result["text"][len(shown) :], flush=True)
        print(
            f"[{len(seq.output)} tokens in {seconds:.2f} s (compilation included), "
            f"finish: {seq.finish_reason}]",
            file=sys.stderr,
        )
    else:
        print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face model folder: continue --prompt")
    parser.add_argument("--prompt", help="the text to continue (with --model)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument(
        "--implementation",
        default=None,
        help="attention backend: xla, triton, mosaic (default: best here)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="default: the config's"
    )
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if (args.model is None) != (args.prompt is None):
        parser.error("--prompt needs --model, and --model needs --prompt")
    if args.model is not None:
        if args.max_new_tokens < 1:
            parser.error("--max-new-tokens must be >= 1")
        return generate_text(args)
    if args.prompt_len < 1 or args.chunk_size < 1 or args.max_new_tokens < 1:
        parser.error("--prompt-len, --chunk-size and --max-new-tokens must be >= 1")

    config = CONFIGS[args.config]
    if args.dtype:
        config = config.with_dtype(args.dtype)
    implementations = resolved_implementations(args.implementation, config.dtype)
    model = Decoder(config, rngs=nnx.Rngs(args.seed))
    prompt = np.random.default_rng(args.seed).integers(0, config.vocab_size, args.prompt_len)
    prompt = prompt.tolist()
    params = SamplingParams(args.max_new_tokens, args.temperature, args.seed)
    max_len = args.prompt_len + args.max_new_tokens
    pool = dict(
        page_size=args.page_size,
        num_pages=-(-max_len // args.page_size),
        max_seqs=1,
        max_model_len=max_len,
    )
    single = Engine(
        model,
        EngineConfig(max_tokens_per_step=args.prompt_len, **pool),
        implementation=args.implementation,
    )
    chunked = Engine(
        model,
        EngineConfig(max_tokens_per_step=args.chunk_size, chunk_size=args.chunk_size, **pool),
        implementation=args.implementation,
    )
    ref, ref_stats = run(single, prompt, params)
    seq, stats = run(chunked, prompt, params)

    implementation = implementations["ragged"]
    if implementations["decode"] != implementation:
        implementation = f"ragged={implementation},decode={implementations['decode']}"
    result = {
        "max_abs_logit_diff": float(np.max(np.abs(seq.prompt_logits - ref.prompt_logits))),
        "tokens_match": seq.output == ref.output,
        "implementation": implementation,
        "prefill_tokens_per_s": stats.prefill_tokens_per_s,
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "single_shot_prefill_tokens_per_s": ref_stats.prefill_tokens_per_s,
        "config": args.config,
        "dtype": jnp.dtype(config.dtype).name,
        "prompt_len": args.prompt_len,
        "chunk_size": args.chunk_size,
        "max_new_tokens": args.max_new_tokens,
        "device": jax.devices()[0].device_kind,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.config} decoder ({config.num_params() / 1e6:.1f}M params, {result['dtype']}) "
            f"on {result['device']}, attention implementation: {implementation}"
        )
        print(
            f"prompt {args.prompt_len} tokens, chunk {args.chunk_size}, "
            f"{args.max_new_tokens} new tokens, page size {args.page_size}"
        )
        print(
            f"max |logit diff|, chunked vs single-shot prefill: "
            f"{result['max_abs_logit_diff']:.3g} (over {ref.prompt_logits.size} logits)"
        )
        print(f"generated tokens match: {result['tokens_match']}  {seq.output}")
        print(
            f"prefill: {stats.prefill_tokens_per_s:,.0f} tokens/s chunked, "
            f"{ref_stats.prefill_tokens_per_s:,.0f} tokens/s single-shot"
        )
        print(f"decode: {stats.decode_tokens_per_s:,.0f} tokens/s (batch 1)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
