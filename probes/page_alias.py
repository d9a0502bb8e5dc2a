"""Probe: can a Mosaic GPU kernel write new K/V rows into the page pool in place? (issue 20)

Two levers left for the decode step need it: `rope_append` folded into the Mosaic decode
kernel's prologue (benchmarks/NOTES.md, session 34), and a Mosaic GPU `rope_append` to replace
the Triton one when JAX removes that lowering. `plgpu.kernel` takes no `input_output_aliases`
in jax 0.11.2; what it does take are refs (`jax.new_ref`), which `pallas_kernels.mosaic.common.
launch` already uses for poisoned outputs. The question is whether XLA then copies the whole
pool into the ref's buffer on every call, or aliases the donated pool.

Each case writes one [1, Hkv, D] row per call into a 256 MB pool (8,192 pages of 16 tokens,
8 KV heads, D 128, bfloat16), 200 calls in one jitted `fori_loop` (one call per iteration, to a
new slot each time), timed from the host:
  - `xla`: `pages.at[page, offset].set(row)`, XLA's in-place dynamic-update-slice (the floor);
  - `mosaic_ref`: the pool wrapped in `jax.new_ref`, a one-warpgroup Mosaic GPU kernel that
    TMA-copies the row to its slot, the ref read back.
A copy of the pool would cost ~80 us a call at ~3.3 TB/s; an in-place write a few us. It also
checks that the rows land where they should and that every other row is unchanged, and
counts the copies in each case's optimized HLO.

    python -m probes.page_alias --out results.json
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text

PAGES, PAGE, HKV, D = 8192, 16, 8, 128
CALLS = 200


def xla_write(pages, row, slot):
    return lax.dynamic_update_slice(pages, row[None, None], (slot // PAGE, slot % PAGE, 0, 0))


def mosaic_write(pages, row, slot):
    ref = jax.new_ref(pages)

    def body(row_ref, slot_ref, pages_ref, scratch):
        smem, barrier = scratch
        s = slot_ref[0]
        plgpu.copy_gmem_to_smem(row_ref, smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.copy_smem_to_gmem(smem, pages_ref.at[s // PAGE, pl.ds(s % PAGE, 1)])
        plgpu.wait_smem_to_gmem(0)

    plgpu.kernel(
        body,
        out_type=(),
        grid=(1,),
        grid_names=("x",),
        scratch_types=((plgpu.SMEM((1, HKV, D), pages.dtype), plgpu.Barrier()),),
    )(row[None], slot[None], ref)
    return ref[...]


def looped(write):
    def run(pages, rows):
        def body(i, pages):
            return write(pages, rows[i], i * 37 % (PAGES * PAGE))

        return lax.fori_loop(0, CALLS, body, pages)

    return jax.jit(run, donate_argnums=0)


def case(name, write, seed=0):
    rng = np.random.default_rng(seed)
    host = rng.standard_normal((PAGES, PAGE, HKV, D), np.float32).astype(jnp.bfloat16)
    rows = jnp.asarray(rng.standard_normal((CALLS, HKV, D), np.float32), jnp.bfloat16)
    fn = looped(write)
    result = dict(case=name)
    try:
        pages = jnp.asarray(host)
        compiled = fn.lower(pages, rows).compile()
        text = compiled.as_text()
        copies = [
            line.strip()[:160] for line in text.splitlines() if re.search(r"= \S+ copy", line)
        ]
        result["hlo_copies"] = copies
        out = np.asarray(jax.block_until_ready(fn(pages, rows)), np.float32)
        expect = host.astype(np.float32)
        for i in range(CALLS):
            s = i * 37 % (PAGES * PAGE)
            expect[s // PAGE, s % PAGE] = np.asarray(rows[i], np.float32)
        result["exact"] = bool(np.array_equal(out, expect))
        times = []
        pages = jnp.asarray(host)
        for _ in range(5):
            start = time.perf_counter()
            pages = jax.block_until_ready(fn(pages, rows))
            times.append(time.perf_counter() - start)
        result["us_per_call"] = 1e6 * float(np.median(times)) / CALLS
    except Exception as e:  # noqa: BLE001 - a probe records and goes on
        result["error"] = error_text(e)
    print(json.dumps(result), flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    cases = [case("xla", xla_write), case("mosaic_ref", mosaic_write)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="page_alias", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
