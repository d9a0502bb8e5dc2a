"""Probe (sessions 11, 13): the kernels of one shared-prefix decode call, CUPTI per kernel name.

python -m probes.cascade_kernels --shared 4096 16384
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks import inputs as bi
from jaxpaged import shared_prefix_decode_attention


def _kernels(fn, args, iterations=20):
    from jax._src.lib import mosaic_gpu  # noqa: PLC0415

    ext = mosaic_gpu._mosaic_gpu_ext
    jax.block_until_ready(fn(*args))
    ext._cupti_init()
    jax.block_until_ready(jnp.ones((256, 256)) @ jnp.ones((256, 256)))
    ext._cupti_get_timings(True)
    ext._cupti_init()
    for _ in range(iterations):
        out = fn(*args)
    jax.block_until_ready(out)
    timings = ext._cupti_get_timings(True)
    by_name = {}
    for name, ms in timings:
        by_name.setdefault(name[:70], []).append(ms)
    total = sum(ms for _, ms in timings) / iterations
    rows = sorted(
        ((sum(v) / iterations * 1e3, len(v) / iterations, n) for n, v in by_name.items()),
        reverse=True,
    )
    return total * 1e3, rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shared", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args(argv)
    for shared in args.shared:
        inputs, private_table = bi.make_shared_prefix_inputs(8, 8, shared, 128)
        for impl in ("mosaic",):
            variants = {
                "private": (
                    jax.jit(bi.mosaic_decode_fn)
                    if impl == "mosaic"
                    else jax.jit(bi.public_triton_decode_fn(False)),
                    (*inputs[:4], private_table),
                )
            }
            for splits in (None, 1, 3):
                op = jax.jit(
                    functools.partial(
                        shared_prefix_decode_attention,
                        implementation=impl,
                        prefix_num_splits=splits,
                    )
                )
                variants[f"cascade splits {splits}"] = (op, inputs)
            for name, (fn, a) in variants.items():
                try:
                    total, rows = _kernels(fn, a)
                except Exception as e:  # noqa: BLE001
                    print(f"{shared} {impl} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                    continue
                print(f"== shared {shared} {impl} {name}: {total:.1f} us per call")
                for us, count, kname in rows[:12]:
                    print(f"     {us:8.2f} us  x{count:.0f}  {kname}")


if __name__ == "__main__":
    main()
