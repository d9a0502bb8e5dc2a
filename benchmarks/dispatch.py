"""Host cost of launching kernels from one jitted call: how long the call takes to return
(dispatch) and to finish (wall) for a chain of N tiny kernels, under this process's XLA flags.

    python -m benchmarks.dispatch --kernels 50 300 --out dispatch.json

A step of the ~1B decoder launches 300-400 kernels; when each costs the host microseconds to
launch, a step whose GPU work is shorter than that waits on the host (benchmarks/NOTES.md, e2e).
Set `XLA_FLAGS` (command buffers, their minimum size) to compare launch paths in separate runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import print_table, write_results


def chain(num_kernels: int):
    """A jitted function of `num_kernels` elementwise kernels that XLA may not fuse."""

    def fn(x):
        for _ in range(num_kernels):
            x = jax.lax.optimization_barrier(jnp.sin(x) * 1.0001)
        return x

    return jax.jit(fn)


def measure(num_kernels: int, iterations: int) -> dict:
    fn = chain(num_kernels)
    x = jax.random.normal(jax.random.key(0), (1024,), jnp.float32)
    jax.block_until_ready(fn(x))
    dispatch, wall = [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        y = fn(x)
        t1 = time.perf_counter()
        jax.block_until_ready(y)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        wall.append(t2 - t0)
    return dict(
        kernels=num_kernels,
        dispatch_ms=1e3 * statistics.median(dispatch),
        wall_ms=1e3 * statistics.median(wall),
        dispatch_us_per_kernel=1e6 * statistics.median(dispatch) / num_kernels,
        wall_us_per_kernel=1e6 * statistics.median(wall) / num_kernels,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, nargs="*", default=[50, 300])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cases = [measure(n, args.iterations) for n in args.kernels]
    print_table(cases, list(cases[0]))
    if args.out:
        write_results(args.out, "dispatch", cases)
    return cases


if __name__ == "__main__":
    main()
