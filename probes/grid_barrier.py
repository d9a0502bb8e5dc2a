"""Probe: what a grid-wide barrier costs inside one Pallas Mosaic GPU kernel: the first
number a persistent layer kernel needs (benchmarks/NOTES.md, "Session 17").

One program per SM (all resident). Each of `rounds` barriers: every program signals its own
GMEM semaphore of the round (`pl.get_global`, zeroed per call) at GPU scope and waits until
it reaches the program count. CUPTI time of the call per barrier count; the slope is a
barrier's cost. A check: each program writes how many rounds it passed.

    python -m probes.grid_barrier --out results.json
"""

import argparse
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms
from pallas_kernels.common import device_num_sms


def barrier_kernel(rounds: int, num_programs: int):
    def body(out_ref):
        program = jax.lax.axis_index("program")
        if rounds:
            sems = pl.get_global(plgpu.SemaphoreType.REGULAR((rounds,)))
            for r in range(rounds):
                plgpu.semaphore_signal(sems.at[r], 1, memory_scope="gpu")
                plgpu.semaphore_wait(sems.at[r], num_programs, decrement=False, memory_scope="gpu")
        out_ref[program] = jnp.int32(rounds)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_programs,), jnp.int32),
        grid=(num_programs,),
        grid_names=("program",),
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, nargs="+", default=[0, 1, 4, 16, 64])
    args = parser.parse_args()
    num_programs = device_num_sms()
    cases = []
    for rounds in args.rounds:
        case = dict(rounds=rounds, programs=num_programs)
        try:
            fn = jax.jit(barrier_kernel(rounds, num_programs))
            got = fn()
            case["check"] = bool(jnp.all(got == rounds))
            case["us"] = kernel_time_ms(fn) * 1e3
        except Exception as e:  # noqa: BLE001 - a probe records and goes on
            case["error"] = error_text(e)
        print(json.dumps(case), flush=True)
        cases.append(case)
    base = next((c["us"] for c in cases if c.get("rounds") == 0 and "us" in c), None)
    for c in cases:
        if base is not None and c.get("rounds") and "us" in c:
            c["us_per_barrier"] = (c["us"] - base) / c["rounds"]
    print(json.dumps([c.get("us_per_barrier") for c in cases]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="grid_barrier", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
