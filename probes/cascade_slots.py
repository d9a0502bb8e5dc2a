"""Probe (session 14): where the Mosaic cascade's time goes at 8 prompts x 8 samples.

The plan has max(1, S // 2) group slots (32 at S=64) for 8 groups: the prefix call runs 3/4 of
its items empty, and its q packing gathers zeros for them. Variants: the plan cut to the
groups there are; prefix splits; the suffix call in the Triton kernel. CUPTI per kernel, and
one call's kernels in launch order.

python -m probes.cascade_slots --shared 4096 16384
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from benchmarks import inputs as bi
from jaxpaged import paged_decode_attention
from jaxpaged.shared_prefix import _cascade, default_prefix_splits


def _kernels(fn, args, iterations=20):
    from jax._src.lib import mosaic_gpu  # noqa: PLC0415

    ext = mosaic_gpu._mosaic_gpu_ext
    jax.block_until_ready(fn(*args))
    ext._cupti_init()
    jax.block_until_ready(jnp.ones((256, 256)) @ jnp.ones((256, 256)))
    ext._cupti_get_timings(True)
    ext._cupti_init()
    jax.block_until_ready(fn(*args))
    first = ext._cupti_get_timings(True)
    ext._cupti_init()
    for _ in range(iterations):
        out = fn(*args)
    jax.block_until_ready(out)
    timings = ext._cupti_get_timings(True)
    by_name = {}
    for name, ms in timings:
        by_name.setdefault(name[:60], []).append(ms)
    total = sum(ms for _, ms in timings) / iterations
    rows = sorted(
        ((sum(v) / iterations * 1e3, len(v) / iterations, n) for n, v in by_name.items()),
        reverse=True,
    )
    return total * 1e3, rows, [(n[:40], round(ms * 1e3, 2)) for n, ms in first]


class _SuffixIn:
    """A `decode` for `_cascade` whose prefix call is Mosaic's and suffix call `suffix`'s."""

    def __init__(self, suffix):
        self.keywords = dict(
            implementation="mosaic", sm_scale=None, logits_soft_cap=None, interpret=False
        )
        self.suffix = suffix

    def __call__(self, *args, **kw):
        return paged_decode_attention(*args, return_lse=True, implementation=self.suffix, **kw)


def _cascade_fn(groups: int | None, splits: int, suffix: str = "mosaic"):
    def fn(q, k, v, kv_lens, table, plan):
        if groups is not None:
            plan = dataclasses.replace(
                plan,
                prefix_members=plan.prefix_members[:groups],
                prefix_kv_lens=plan.prefix_kv_lens[:groups],
                prefix_table=plan.prefix_table[:groups],
            )
        return _cascade(_SuffixIn(suffix), q, k, v, plan, prefix_num_splits=splits)

    return jax.jit(fn)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shared", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args(argv)
    for shared in args.shared:
        inputs, private_table = bi.make_shared_prefix_inputs(8, 8, shared, 128)
        variants = {"private": (jax.jit(bi.mosaic_decode_fn), (*inputs[:4], private_table))}
        q, table = inputs[0], inputs[4]
        splits_default = default_prefix_splits("mosaic", 8, 8, table.shape[1] * 16, 128, q.dtype)
        reference = None
        for groups, splits, suffix in [
            (None, splits_default, "mosaic"),
            (8, splits_default, "mosaic"),
            (8, 1, "mosaic"),
            (8, 4, "mosaic"),
            (8, 8, "mosaic"),
            (None, splits_default, "triton"),
            (8, splits_default, "triton"),
        ]:
            name = f"cascade slots {groups or 32} splits {splits} suffix {suffix}"
            variants[name] = (_cascade_fn(groups, splits, suffix), inputs)
        for name, (fn, a) in variants.items():
            try:
                total, rows, first = _kernels(fn, a)
                out = jax.block_until_ready(fn(*a))
                out = out[0] if isinstance(out, tuple) else out
                if reference is None and name != "private":
                    reference = out
                diff = (
                    float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
                    if reference is not None
                    else 0.0
                )
            except Exception as e:  # noqa: BLE001
                print(f"{shared} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            print(f"== shared {shared} {name}: {total:.1f} us per call (max diff {diff:.3g})")
            for us, count, kname in rows[:8]:
                print(f"     {us:8.2f} us  x{count:.0f}  {kname}")
            print("     in order:", first)


if __name__ == "__main__":
    main()
