"""Hashes of the Mosaic GPU modules that the decode and prefill kernels lower to, per config.

A refactor that is meant to leave the kernels alone must leave these hashes alone. Runs on a
machine without a GPU (cross-lowering for sm_90, as `tests/helpers.lower_for_cuda`):

    PYTHONPATH=$TREE python tests/mosaic_modules.py [--dump DIR] > hashes.json

prints, for every config, the SHA-256 of each Mosaic GPU module in the order the lowering
emits them. A module is hashed as its MLIR text without locations (source lines and scopes
are not the kernel) and without `mosaic_gpu.dump_basename` (a per-process counter). The
configs use only names that every version of the kernels has had, so that the script runs on
old trees too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import re

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax.experimental.mosaic.gpu import core as mosaic_core
from jax.experimental.mosaic.gpu import dialect as mosaic_dialect
from jaxlib.mlir import ir

from pallas_kernels.common import poison_outputs
from pallas_kernels.mosaic import paged_decode, ragged_prefill
from tests.helpers import lower_for_cuda

I32 = jnp.int32


def _decode_args(seqs, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq, dtype):
    """q [S, Hq, D], k_pages, v_pages, kv_lens, page_indices."""
    kv = jax.ShapeDtypeStruct((seqs * pages_per_seq + 3, page_size, num_kv_heads, head_dim), dtype)
    return (
        jax.ShapeDtypeStruct((seqs, num_q_heads, head_dim), dtype),
        kv,
        kv,
        jax.ShapeDtypeStruct((seqs,), I32),
        jax.ShapeDtypeStruct((seqs, pages_per_seq), I32),
    )


def _prefill_args(tokens, seqs, *shape):
    """q [T, Hq, D], k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs."""
    q, *paged = _decode_args(seqs, *shape)
    return (
        jax.ShapeDtypeStruct((tokens, *q.shape[1:]), q.dtype),
        *paged,
        jax.ShapeDtypeStruct((seqs + 1,), I32),
        jax.ShapeDtypeStruct((1,), I32),
    )


def _decode(args, poison=False, **options):
    return ("decode", args, dict(sm_scale=0.088, **options), poison)


def _prefill(args, poison=False, **options):
    return ("prefill", args, dict(sm_scale=0.088, **options), poison)


BF16, F16 = jnp.bfloat16, jnp.float16
DecodeConfig = paged_decode.MosaicDecodeConfig
PrefillConfig = ragged_prefill.MosaicPrefillConfig

# name -> (kernel, abstract args, options, poisoned outputs)
CASES = {
    # B=1 ctx 32768: the default config, 16 splits (128 items: the grid of items).
    "decode-b1-ps16-ctx32768": _decode(_decode_args(1, 32, 8, 128, 16, 2048, BF16)),
    # B=8 ctx 32768 at page 64: 2 splits.
    "decode-b8-ps64-ctx32768": _decode(_decode_args(8, 32, 8, 128, 64, 512, BF16)),
    # B=64 ctx 4096: one split, slots ranked inside the kernel.
    "decode-b64-ps16-ctx4096": _decode(_decode_args(64, 32, 8, 128, 16, 256, BF16)),
    # More slots than the kernel ranks: XLA's sort orders them.
    "decode-b200-ps16-ctx1024": _decode(_decode_args(200, 32, 8, 128, 16, 64, BF16)),
    # One program per item, forced splits, window and soft cap.
    "decode-b8-ps16-grid-splits3-window-cap": _decode(
        _decode_args(8, 32, 8, 128, 16, 64, BF16),
        num_splits=3,
        sliding_window=700,
        logits_soft_cap=30.0,
        config=DecodeConfig(persistent=False),
    ),
    # Persistent in slot order, D=64, group 4, block_kv 64 with 4 stages.
    "decode-b64-ps64-unordered-d64": _decode(
        _decode_args(64, 8, 2, 64, 64, 32, F16),
        config=DecodeConfig(block_kv=64, num_stages=4, longest_first=False),
    ),
    # D=256 (not persistent by default), an odd group (12) that starts mid-tile.
    "decode-b4-ps16-d256-group12": _decode(_decode_args(4, 24, 2, 256, 16, 40, BF16)),
    # Poisoned outputs (refs aliased to the outputs), one split.
    "decode-b8-ps16-poisoned": _decode(
        _decode_args(8, 32, 8, 128, 16, 64, BF16), poison=True, num_splits=1
    ),
    # B=1 T=8192 prefill at page 64.
    "prefill-t8192-s1-ps64": _prefill(_prefill_args(8192, 1, 32, 8, 128, 64, 128, BF16)),
    # A ragged batch with a sliding window, D=64, no GQA.
    "prefill-t300-s4-ps16-window": _prefill(
        _prefill_args(300, 4, 4, 4, 64, 16, 16, F16), sliding_window=5
    ),
    # Soft cap, not causal, D=256, group 8.
    "prefill-t301-s4-ps16-d256-cap-noncausal": _prefill(
        _prefill_args(301, 4, 16, 2, 256, 16, 16, BF16), logits_soft_cap=3.0, causal=False
    ),
    # Many short sequences (a mixed batch), page 16, window.
    "prefill-t64-s16-ps16-window": _prefill(
        _prefill_args(64, 16, 32, 8, 128, 16, 32, BF16), sliding_window=300
    ),
    # block_kv 64 with 3 stages, every sequence in the prefill kernel.
    "prefill-t517-s4-ps16-bkv64": _prefill(
        _prefill_args(517, 4, 32, 8, 128, 16, 16, BF16),
        config=PrefillConfig(block_kv=64, num_stages=3, short_sequences=False),
    ),
    # Poisoned outputs.
    "prefill-t300-s4-ps64-poisoned": _prefill(
        _prefill_args(300, 4, 32, 8, 128, 64, 16, BF16), poison=True
    ),
}


def mosaic_modules(kernel, args, options, poison) -> list[str]:
    """The Mosaic GPU modules of one lowering, as MLIR text without locations."""
    entry = (
        paged_decode.paged_decode_attention
        if kernel == "decode"
        else ragged_prefill.ragged_paged_attention
    )
    mosaic_core.KNOWN_KERNELS.clear()
    if poison:
        with poison_outputs():
            lower_for_cuda(lambda *a: entry(*a, **options), *args)
    else:
        lower_for_cuda(lambda *a: entry(*a, **options), *args)
    texts = []
    with mlir.make_ir_context() as context:
        context.allow_unregistered_dialects = True  # the serialized `stable_mosaic_gpu` ops
        mosaic_dialect.register_dialect(context)  # its types (barriers) inside memrefs
        for bytecode in mosaic_core.KNOWN_KERNELS.values():
            module = ir.Module.parse(bytecode)
            text = module.operation.get_asm(enable_debug_info=False)
            texts.append(re.sub(r'mosaic_gpu.dump_basename = "[^"]*", ', "", text))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=pathlib.Path, help="also write each module's text here")
    parser.add_argument("--cases", nargs="*", help="only these cases")
    args = parser.parse_args()
    hashes = {}
    for name, case in CASES.items():
        if args.cases and name not in args.cases:
            continue
        texts = mosaic_modules(*case)
        hashes[name] = [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts]
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            for i, text in enumerate(texts):
                (args.dump / f"{name}.{i}.mlir").write_text(text)
    print(json.dumps(hashes, indent=1))


if __name__ == "__main__":
    main()
