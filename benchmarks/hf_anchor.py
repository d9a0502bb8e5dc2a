"""The torch anchor of the end-to-end benchmark: Hugging Face transformers' `Qwen3ForCausalLM`
of the `1b` config's shape (random weights, bf16, CUDA), greedy decode with a static KV cache
and torch.compile (`cache_implementation="static"` compiles the decode step itself).

    python -m benchmarks.hf_anchor --batches 1 16 64 --ctx 1024 [--model PATH]

`--model` loads a Hugging Face model folder (in its `torch_dtype`) instead.

Prints one JSON object: versions and, per batch, the time of a decode step at `--ctx` cached
tokens, from two generations of different lengths after a warm-up: (t(long) - t(short)) /
(long - short), so that the prompt's prefill cancels. Runs in its own process: torch and JAX
in one process fight over GPU memory.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=64)
    parser.add_argument("--model", default=None, help="a Hugging Face model folder")
    args = parser.parse_args(argv)

    import torch  # noqa: PLC0415 - only the GPU image has it
    import transformers  # noqa: PLC0415

    from models.config import CONFIGS  # noqa: PLC0415

    torch.manual_seed(0)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
        name = f"{type(model).__name__} from {args.model}, {model.dtype}"
    else:
        c = CONFIGS["1b"]
        config = transformers.Qwen3Config(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_q_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.norm_eps,
            tie_word_embeddings=False,
        )
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
        name = "Qwen3ForCausalLM, bf16"
    model = model.to("cuda").eval()
    vocab_size = model.config.vocab_size

    def generate(ids, n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                cache_implementation="static",
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - start

    cases = []
    for batch in args.batches:
        ids = torch.randint(0, vocab_size, (batch, args.ctx), device="cuda")
        generate(ids, args.long)  # compiles
        generate(ids, args.short)
        short = min(generate(ids, args.short) for _ in range(2))
        long = min(generate(ids, args.long) for _ in range(2))
        step = (long - short) / (args.long - args.short)
        cases.append(
            dict(batch=batch, ctx=args.ctx, ms_per_step=1e3 * step, tokens_per_s=batch / step)
        )
    result = dict(
        anchor=f"HF transformers {name}, static cache + torch.compile",
        torch=torch.__version__,
        transformers=transformers.__version__,
        cases=cases,
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
