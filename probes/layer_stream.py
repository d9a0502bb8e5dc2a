"""Probe: how fast one persistent Mosaic GPU kernel streams a decoder layer's weights through
its four projections, with a grid barrier at each phase boundary, against XLA's four GEMMs
(benchmarks/NOTES.md, "Session 25"): the number a persistent layer kernel stands on.

At decode batches every projection costs a ramp and a tail of ~2 us besides its bytes (runs
86-104), and the small kernels between them cost 1.2-1.9 us each. A persistent kernel would pay
one ramp a layer: its weight copies run on across the phases, and only the activations wait at
a grid barrier (0.8 us idle, run 98; ~1.7 us with copies in flight, run 134) where the step
now has a kernel boundary.

The skeleton: the layer's weights as one [2048, 24576] bf16 array per layer, its column ranges
the phases (qkv 4096, o 2048, gate/up 12288, down 6144 columns: the down projection's bytes in
the same shape), x [T, 2048]. Every program (one per SM) takes an equal, contiguous share of each
phase's (64-column tile, K step) iterations, phase after phase, and runs them all as one
`emit_pipeline` of TMA copies and a `wgmma` each (the weights as `wgmma`'s M, x as its N).
Before its first iteration of a phase a program signals that it is done with the phase
before, and waits until every program has (`barriers=True`); copies already in flight keep
streaming while it waits. Tiles split between programs are not summed and every phase reads
the same x: this measures the weight stream and the barriers, not a layer's arithmetic. Run 133
gave each phase to a contiguous run of programs instead, and its barriers serialized them.

Cases, per layer (16 layers, each with its own weights: 1.6 GB, past the 60 MB L2), CUPTI:
  - `fused`: the skeleton, barriers on;
  - `fused_nobarrier`: the same without barriers (what the barriers cost);
  - `per_phase`: the same kernel once per phase, on four arrays of the phases' shapes (what a
    kernel boundary costs the stream);
  - `per_phase_pdl`: the same with each kernel a programmatic dependent of the one before,
    its first weight tiles prefetched into the L2 before it waits (session 26);
  - `xla`: the four projections as the step computes them (x @ qkv, a slice @ o, @ gate/up,
    SwiGLU @ down), each layer's input its predecessor's output;
  - `ws`, `ws_nobarrier`: `fused` and `fused_nobarrier` in a copy and a compute warpgroup
    (`stream_ws`, session 28);
  - `ws_dynamic`, `ws_dynamic_nobarrier`: the same with the last `--tails` of each phase
    handed out `--chunks` iterations at a time by a GMEM counter;
  - `ws_dependent`: `ws` with a dependent load of `--dependent-kb` after each barrier, its
    stores complete before it (`stream_ws`'s `act`, session 45);
  - `ws_counters`, `ws_counters_dependent`: `ws` and `ws_dependent` with the barriers
    counting in a ref that outlives the call, no memset before it (`stream_ws`'s `counters`).

    python -m probes.layer_stream --rows 2 16 --out results.json
"""

import argparse
import functools
import glob
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import memref
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms, step_time_ms
from pallas_kernels.common import device_num_sms
from pallas_kernels.mosaic.layer import grid_barrier, proxy_fence, select
from pallas_kernels.mosaic.pipeline import TILED

HIDDEN, QKV, INTER = 2048, 4096, 6144
PHASE_COLS = (QKV, HIDDEN, 2 * INTER, INTER)  # qkv, o, gate/up, down (as [2048, 6144])
TILE_N = 64
LAYERS = 16
GRAPH_OPTIONS = dict(
    xla_gpu_enable_command_buffer="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE",
    xla_gpu_graph_min_graph_size=1,
)
LOOPS = 10  # the chain's repeats inside one graphed while loop, for its wall time


def looped(fn):
    """`fn(x, ws)` LOOPS times in one while loop in one command buffer; each repeat's x takes a
    (zero) dependence on every output of the last, so that no kernel is dead or invariant."""

    def run(x, ws):
        def body(_, x):
            outs = jax.tree.leaves(fn(x, ws))
            dep = sum(o.reshape(-1)[:1].astype(jnp.float32) for o in outs) * 0
            return x + dep.astype(x.dtype)[None]

        return lax.fori_loop(0, LOOPS, body, x)

    return jax.jit(run, compiler_options=GRAPH_OPTIONS)


def stream(
    x,
    w,
    *,
    phase_cols,
    tile_k=128,
    stages=4,
    barriers=True,
    num_programs=None,
    pdl=False,
    profile_dir=None,
):
    """One call of the skeleton: x [R, K] (R a multiple of 8), w [K, sum(phase_cols)].
    Returns each program's last tile ([P, R, 64] bf16), so that nothing is dead.

    `pdl`: launched as a programmatic dependent of the kernel before, each program lets the
    kernel after it launch at once, prefetches its first `stages` weight tiles into the L2,
    and only then waits for the kernel before to finish (weights do not depend on it).

    `profile_dir`: Mosaic GPU's in-kernel profiler writes each program's "kernel" scope and
    its barrier waits ("barrier0", ...) there (`barrier_trace` reads them)."""
    rows, k = x.shape
    n = w.shape[1]
    assert n == sum(phase_cols) and k % tile_k == 0 and rows % 8 == 0
    k_steps = k // tile_k
    sizes = [c // TILE_N * k_steps for c in phase_cols]  # iterations of each phase
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    num_programs = min(num_programs or device_num_sms(), min(sizes))
    max_count = sum(pl.cdiv(z, num_programs) for z in sizes)

    def layer_stream(x_ref, w_ref, out_ref, y_smem):
        program = lax.axis_index("program")
        # Every program takes an equal contiguous share of every phase, phase after phase.
        lo = [program * z // num_programs for z in sizes]
        size = [(program + 1) * z // num_programs - a for z, a in zip(sizes, lo, strict=True)]
        local = [sum(size[:j], jnp.int32(0)) for j in range(len(sizes))]
        count = local[-1] + size[-1]
        num_barriers = len(sizes) - 1 if barriers else 0
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_barriers,))) if num_barriers else None

        def iteration(i):
            i = jnp.minimum(i, count - 1)
            g = jnp.int32(0)
            for j in range(len(sizes)):
                inside = (i >= local[j]) & (i < local[j] + size[j])
                g = jnp.where(inside, starts[j] + lo[j] + (i - local[j]), g)
            return g

        def step(indices, x_smem, w_smem, acc):
            (i,) = indices
            g = iteration(i)
            live = i < count
            # Before a phase's first iteration, wait until every program is done with the last.
            for b in range(num_barriers):

                @pl.when(live & (i == local[b + 1]))
                @jax.named_scope(f"barrier{b}")
                def _(b=b):
                    plgpu.semaphore_signal(sems.at[b], 1, memory_scope="gpu")
                    plgpu.semaphore_wait(
                        sems.at[b], num_programs, decrement=False, memory_scope="gpu"
                    )

            col = plgpu.broadcasted_iota(jnp.int32, (TILE_N, rows), 0, layout=plgpu.Layout.WGMMA)

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)

            acc = jnp.where(
                col < jnp.where(live, TILE_N, 0),
                pl.run_state(mma)(plgpu.ACC.init(acc)),
                acc,
            )
            last_of_phase = functools.reduce(
                jnp.logical_or, [i == local[j] + size[j] - 1 for j in range(len(sizes))]
            )
            ends = live & ((lax.rem(g, k_steps) == k_steps - 1) | last_of_phase)

            @pl.when(ends)
            def _():
                y_smem.T[...] = acc.astype(y_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem, out_ref.at[program])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            return jnp.where(col < jnp.where(ends, 0, TILE_N), acc, jnp.zeros_like(acc))

        def run_stream():
            if pdl:
                plgpu.griddepcontrol_launch_dependents()
                for i in range(stages):
                    g = iteration(jnp.int32(i))
                    k_step, col = lax.rem(g, k_steps), g // k_steps
                    plgpu.async_prefetch(
                        w_ref.at[pl.ds(k_step * tile_k, tile_k), pl.ds(col * TILE_N, TILE_N)],
                        predicate=i < count,
                    )
                plgpu.griddepcontrol_wait()
            zero = plgpu.layout_cast(jnp.zeros((TILE_N, rows), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.emit_pipeline(
                step,
                grid=(max_count,),
                in_specs=[
                    plgpu.BlockSpec(
                        (rows, tile_k),
                        lambda i: (0, lax.rem(iteration(i), k_steps)),
                        transforms=TILED,
                    ),
                    plgpu.BlockSpec(
                        (tile_k, TILE_N),
                        lambda i: (lax.rem(iteration(i), k_steps), iteration(i) // k_steps),
                        transforms=TILED,
                    ),
                ],
                max_concurrent_steps=stages,
                init_carry=zero,
            )(x_ref, w_ref)

        with jax.named_scope("kernel"):
            run_stream()

    return plgpu.kernel(
        layer_stream,
        out_type=jax.ShapeDtypeStruct((num_programs, rows, TILE_N), x.dtype),
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=(plgpu.SMEM((rows, TILE_N), x.dtype),),
        compiler_params=plgpu.CompilerParams(
            **(dict(profile_space=64, profile_dir=profile_dir) if profile_dir else {})
        ),
    )(x, w)


def _fetch_add(counter, claim_smem):
    """claim_smem[0] = atomicAdd(counter, 1) for the whole warpgroup: one thread's relaxed
    GPU-scope `atom.add` (Pallas' `atomic_add` returns nothing), handed to the others through
    shared memory and a warpgroup barrier."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def fetch(ctx, counter_ref, out_ref):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        ptr = mgpu_utils.memref_ptr(counter_ref)
        with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
            old = mgpu_utils.inline_ptx(
                "atom.relaxed.gpu.global.add.u32 $0, [$1], $2;",
                ptr,
                mgpu_utils.c(1, i32),
                result_types=i32,
                has_side_effects=True,
            )
            memref.store(old, out_ref, [mgpu_utils.c(0, ir.IndexType.get())])
        mgpu_utils.warpgroup_barrier()

    fetch(counter, claim_smem)


def stream_ws(
    x,
    w,
    *,
    phase_cols,
    tile_k=128,
    stages=4,
    barriers=True,
    tail=0.0,
    chunk=2,
    num_programs=None,
    profile_dir=None,
    act=None,
    counters=None,
    parity=0,
):
    """The skeleton of `stream` in two warpgroups, with the tail of each phase handed out at
    run time. x [R, K] (R a multiple of 8), w [K, sum(phase_cols)]; returns each program's last
    tile ([P, R, 64] bf16) and per program and phase the number and the sum of the iterations it
    ran ([P, phases, 2] int32: summed over programs, they show each iteration ran once).

    A copy warpgroup issues each iteration's x and weight tiles into `stages` shared-memory
    slots and writes the slot's iteration (global index, phase, whether its tile ends there)
    beside it; a compute warpgroup runs the `wgmma`s, stores each finished tile, and before a
    phase's first iteration waits at the grid barrier (`barriers`). Of each phase's
    iterations the first `1 - tail` are split in equal contiguous static shares; the rest go
    in runs of `chunk` iterations to whichever program asks first: a program done with its
    static share takes the next run from the phase's counter (`_fetch_add`) until none is
    left, then goes on to its share of the next phase. The copy warpgroup asks, so the
    counter's latency sits behind the copies it already has in flight. With `tail=0` the
    shares are static, as in `stream`. `profile_dir`: as `stream`'s, the compute warpgroup's
    scopes.

    Two things a layer kernel with real arithmetic adds at each barrier (session 45):
    - `act` ([n, 128] float32, n <= 256): a dependent load. Before it signals, a program waits
      until its stored tiles are complete (not only read), and after the barrier it copies
      all of `act` into shared memory and waits for it before its next `wgmma`, as a program
      must load the last phase's outputs (the norm's partial sums, the SwiGLU product) before
      it can use them. This prices the load that queues behind the program's weight copies
      already in flight (session 28).
    - `counters` (a `jax.new_ref` of [3, barriers] int32, zero when first used): the barriers
      count in `counters[parity]` instead of `pl.get_global` semaphores, which XLA zeroes
      before every call with a memset node (1.39 us in the step, run 154). Program 0 zeroes
      `counters[1 - parity]` as it starts, for the next call: calls that alternate `parity`
      (in stream order, so the call before has finished) never need a memset. `counters[2]`
      counts the programs that gave up waiting (`grid_barrier`)."""
    rows, k = x.shape
    n = w.shape[1]
    assert n == sum(phase_cols) and k % tile_k == 0 and rows % 8 == 0
    k_steps = k // tile_k
    sizes = [c // TILE_N * k_steps for c in phase_cols]
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    num_programs = min(num_programs or device_num_sms(), min(sizes))
    statics = [round((1 - tail) * z) for z in sizes]  # the statically shared iterations
    phases = len(sizes)
    num_barriers = phases - 1 if barriers else 0

    def kernel(*refs):
        x_ref, w_ref, *refs = refs
        act_ref = refs.pop(0) if act is not None else None
        counters_ref = refs.pop(0) if counters is not None else None
        out_ref, ran_ref, x_smem, w_smem, meta_smem, claim_smem, y_smem, bars, act_scratch = refs
        ready, free = bars
        program = lax.axis_index("program")
        wg = lax.axis_index("wg")
        # Each `pl.get_global` costs a memset node before the call: only where it is used.
        if counters_ref is None and num_barriers:
            sems = pl.get_global(plgpu.SemaphoreType.REGULAR((num_barriers,)))
        if any(s < z for s, z in zip(statics, sizes, strict=True)):
            tails = pl.get_global(plgpu.SemaphoreType.REGULAR((phases,)))

        def static_share(j):
            s = select(statics, j)
            return program * s // num_programs, (program + 1) * s // num_programs

        @pl.when(wg == 1)
        def _copies():
            def claim(j):
                """The next run of phase j's tail: (start, end), start >= size when none."""
                for p in range(phases):
                    if statics[p] < sizes[p]:
                        pl.when(j == p)(lambda p=p: _fetch_add(tails.at[p], claim_smem))
                c = claim_smem[0]
                start = select(statics, j) + c * chunk
                has_tail = select([int(s < z) for s, z in zip(statics, sizes, strict=True)], j) == 1
                start = jnp.where(has_tail, start, select(sizes, j))
                return start, jnp.minimum(start + chunk, select(sizes, j))

            def next_run(j, u, end):
                """At the end of a run of phase j: the next (j, u, end), a claimed run of
                phase j's tail or, when none is left, the static share of phase j + 1."""
                del u, end
                start, stop = claim(j)
                more = start < select(sizes, j)
                lo, hi = static_share(j + 1)
                return (
                    jnp.where(more, j, j + 1),
                    jnp.where(more, start, lo),
                    jnp.where(more, stop, hi),
                )

            def cond(carry):
                return carry[0] < phases

            def body(carry):
                j, u, end, n_ = carry
                slot = lax.rem(n_, stages)

                @pl.when(n_ >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                g = select(starts, j) + u
                k_step, col = lax.rem(g, k_steps), g // k_steps
                meta_smem[slot, 0] = g
                meta_smem[slot, 1] = j
                meta_smem[slot, 2] = ((k_step == k_steps - 1) | (u + 1 == end)).astype(jnp.int32)
                plgpu.copy_gmem_to_smem(
                    x_ref.at[:, pl.ds(k_step * tile_k, tile_k)], x_smem.at[slot], ready.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    w_ref.at[pl.ds(k_step * tile_k, tile_k), pl.ds(col * TILE_N, TILE_N)],
                    w_smem.at[slot],
                    ready.at[slot],
                )
                u = u + 1
                j, u, end = lax.cond(u == end, next_run, lambda *run: run, j, u, end)
                return j, u, end, n_ + 1

            lo, hi = static_share(jnp.int32(0))
            *_, count = lax.while_loop(cond, body, (jnp.int32(0), lo, hi, jnp.int32(0)))
            slot = lax.rem(count, stages)  # the end: a slot that names phase `phases`

            @pl.when(count >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            meta_smem[slot, 1] = jnp.int32(phases)
            plgpu.barrier_arrive(ready.at[slot])
            plgpu.barrier_arrive(ready.at[slot])

        @pl.when(wg == 0)
        @jax.named_scope("kernel")
        def _compute():
            zero = plgpu.layout_cast(jnp.zeros((TILE_N, rows), jnp.float32), plgpu.Layout.WGMMA)

            def read(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(ready.at[slot])
                return meta_smem[slot, 0], meta_smem[slot, 1], meta_smem[slot, 2]

            def cond(carry):
                return carry[3] < phases

            def body(carry):
                i, acc, prev, phase, g, ends, ran = carry
                ran = tuple(
                    (n_ + (phase == p).astype(jnp.int32), s + jnp.where(phase == p, g, 0))
                    for p, (n_, s) in enumerate(ran)
                )
                slot = lax.rem(i, stages)
                for b in range(num_barriers):

                    @pl.when((phase != prev) & (phase == b + 1))
                    @jax.named_scope(f"barrier{b}")
                    def _(b=b):
                        if act_ref is not None:  # the tiles stored must be visible
                            plgpu.wait_smem_to_gmem(0)
                            proxy_fence()
                        if counters_ref is None:
                            plgpu.semaphore_signal(sems.at[b], 1, memory_scope="gpu")
                            plgpu.semaphore_wait(
                                sems.at[b], num_programs, decrement=False, memory_scope="gpu"
                            )
                        else:
                            grid_barrier(counters_ref, parity, b, num_programs)
                        if act_ref is not None:
                            proxy_fence()
                            act_smem, act_barrier = act_scratch
                            plgpu.copy_gmem_to_smem(act_ref, act_smem, act_barrier)
                            plgpu.barrier_wait(act_barrier)

                def mma(acc_ref):
                    plgpu.wgmma(
                        acc_ref,
                        w_smem.at[slot].transpose((1, 0)),
                        x_smem.at[slot].transpose((1, 0)),
                    )

                acc = pl.run_state(mma)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(free.at[slot])

                @pl.when(ends == 1)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    y_smem.T[...] = acc.astype(y_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(y_smem, out_ref.at[program])

                col = plgpu.broadcasted_iota(
                    jnp.int32, (TILE_N, rows), 0, layout=plgpu.Layout.WGMMA
                )
                acc = jnp.where(col < jnp.where(ends == 1, 0, TILE_N), acc, jnp.zeros_like(acc))
                g2, phase2, ends2 = read(i + 1)
                return i + 1, acc, phase, phase2, g2, ends2, ran

            if counters_ref is not None:

                @pl.when(program == 0)
                def _():
                    for b in range(num_barriers):
                        counters_ref[1 - parity, b] = jnp.int32(0)

            g, phase, ends = read(jnp.int32(0))
            none = ((jnp.int32(0), jnp.int32(0)),) * phases
            *_, ran = lax.while_loop(
                cond, body, (jnp.int32(0), zero, jnp.int32(0), phase, g, ends, none)
            )
            for p, (n_, s) in enumerate(ran):
                ran_ref[program, p, 0] = n_
                ran_ref[program, p, 1] = s
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((num_programs, rows, TILE_N), x.dtype),
            jax.ShapeDtypeStruct((num_programs, phases, 2), jnp.int32),
        ),
        grid=(num_programs,),
        grid_names=("program",),
        num_threads=2,
        thread_name="wg",
        scratch_types=(
            plgpu.SMEM((stages, rows, tile_k), x.dtype, transforms=TILED),
            plgpu.SMEM((stages, tile_k, TILE_N), x.dtype, transforms=TILED),
            plgpu.SMEM((stages, 4), jnp.int32),
            plgpu.SMEM((1,), jnp.int32),
            plgpu.SMEM((rows, TILE_N), x.dtype),
            (
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
            ),
            (plgpu.SMEM(act.shape, act.dtype), plgpu.Barrier()) if act is not None else (),
        ),
        compiler_params=plgpu.CompilerParams(
            **(dict(profile_space=64, profile_dir=profile_dir) if profile_dir else {})
        ),
    )(x, w, *(r for r in (act, counters) if r is not None))


def barrier_trace(path, sm_ghz=1.98):
    """Per barrier of one profiled call: how far apart the programs arrive (max - min, us),
    how long after the last arrival they leave (median), and how far apart they leave; and for
    any named region, its median length in a program (`median_us`; each program's pairs of
    begin and end in order).

    The profiler's timestamps are the program's start on the global timer (ns) plus SM clock
    cycles since then; `sm_ghz` turns the cycles into ns (the clock holds 1980 MHz under
    load, NOTES session 7)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    start, spans, per_program = {}, {}, {}
    for e in events:
        if e["name"] == "kernel" and e["ph"] == "B":
            start[e["tid"]] = e["ts"]
    for e in sorted(events, key=lambda e: e["ts"]):  # else a program's first event starts it
        start.setdefault(e["tid"], e["ts"])
    for e in sorted(events, key=lambda e: e["ts"]):
        t0 = start[e["tid"]]
        real = t0 + (e["ts"] - t0) / sm_ghz
        spans.setdefault((e["name"], e["ph"]), []).append(real)
        per_program.setdefault((e["name"], e["tid"], e["ph"]), []).append(real)
    report = {}
    for name in sorted({n for n, _ in spans}):
        begin, end = sorted(spans[name, "B"]), sorted(spans[name, "E"])
        lengths = sorted(
            b_end - b_begin
            for (n, tid, ph), begins in per_program.items()
            if n == name and ph == "B"
            for b_begin, b_end in zip(begins, per_program.get((n, tid, "E"), []), strict=False)
        )
        report[name] = dict(
            programs=len(begin),
            arrive_spread_us=begin[-1] - begin[0],
            leave_after_last_arrival_us=end[len(end) // 2] - begin[-1],
            leave_spread_us=end[-1] - end[0],
            first_arrival_us=begin[0] - min(start.values()),
            median_us=lengths[len(lengths) // 2] if lengths else None,
        )
    return report


def program_spans(path, sm_ghz=1.98):
    """Per named region of one profiled call: each traced warpgroup's first (SM, begin, end,
    trace id) in us from the call's first event (`barrier_trace`'s clock)."""
    with open(path) as f:
        events = sorted(json.load(f)["traceEvents"], key=lambda e: e["ts"])
    start, spans = {}, {}
    for e in events:
        start.setdefault(e["tid"], e["ts"])
    origin = min(start.values())
    for e in events:
        t0 = start[e["tid"]]
        real = t0 + (e["ts"] - t0) / sm_ghz - origin
        span = spans.setdefault(e["name"], {}).setdefault(
            e["tid"], [e["pid"] - 1, None, None, e["tid"]]
        )
        if e["ph"] == "B" and span[1] is None:
            span[1] = real
        elif e["ph"] == "E" and span[2] is None:
            span[2] = real
    return {name: list(by_program.values()) for name, by_program in spans.items()}


def lateness(reports, names, at=1):
    """For each region in `names`, over profiled calls (`program_spans`' reports): the
    arrivals' percentiles after the call's median arrival (`at` 2: the ends'), the release
    after the last arrival, and how much of a program's lateness its SM explains (the
    variance of the SMs' mean lateness over the variance of all; ~1 / calls when the SM does
    not matter), with the SMs latest on average and their trace ids."""
    out = {}
    for name in names:
        late, release, by_sm, tids = [], [], {}, {}
        for report in reports:
            spans = [s for s in report.get(name, []) if s[1] is not None and s[2] is not None]
            if not spans:
                continue
            begins = np.array([s[at] for s in spans])
            median = float(np.median(begins))
            release.append(float(np.median([s[2] for s in spans]) - begins.max()))
            for span in spans:
                late.append(span[at] - median)
                by_sm.setdefault(span[0], []).append(span[at] - median)
                tids.setdefault(span[0], set()).add(span[3])
        if not late:
            continue
        late = np.array(late)
        means = {sm: float(np.mean(v)) for sm, v in by_sm.items()}
        share = float(np.var(list(means.values())) / max(np.var(late), 1e-12))
        worst = sorted(means, key=means.get, reverse=True)[:8]
        out[name] = dict(
            late_p10_p50_p90_max_us=[
                round(float(np.percentile(late, q)), 3) for q in (10, 50, 90, 100)
            ],
            release_after_last_us=round(float(np.median(release)), 3),
            sm_share=round(share, 3),
            latest_sms={int(sm): round(means[sm], 3) for sm in worst},
            latest_trace_ids={int(sm): sorted(tids[sm]) for sm in worst},
        )
    return out


def fused_layers(xs, ws, **kw):
    return [stream(xs, w, phase_cols=PHASE_COLS, **kw) for w in ws]


def ws_layers(xs, ws, *, dependent_kb=0, counters=False, **kw):
    """`stream_ws` over the layers. `dependent_kb`: each barrier followed by a dependent load
    of that many KB (`stream_ws`'s `act`); `counters`: the barriers count in one
    `jax.new_ref` for the whole chain, zeroed once, its two slots taken in turn."""
    if dependent_kb:
        kw["act"] = jnp.ones((dependent_kb * 2, 128), jnp.float32)
    if counters:
        kw["counters"] = jax.new_ref(jnp.zeros((3, len(PHASE_COLS) - 1), jnp.int32))
    out = [stream_ws(xs, w, phase_cols=PHASE_COLS, parity=n % 2, **kw) for n, w in enumerate(ws)]
    return out


def covers_every_iteration(ran, k_steps) -> bool:
    """Whether `stream_ws`'s per-program counts and sums of iterations ([P, phases, 2], one
    layer's) add up to every iteration of every phase once."""
    sizes = [c // TILE_N * k_steps for c in PHASE_COLS]
    total = jnp.sum(ran, axis=0).tolist()  # sums < 2**31: 6,144 iterations a layer
    starts = itertools.accumulate([0, *sizes])
    return total == [[z, sum(range(s, s + z))] for z, s in zip(sizes, starts, strict=False)]


def per_phase_layers(xs, wss, **kw):
    return [stream(xs, w, phase_cols=(w.shape[1],), barriers=False, **kw) for ws in wss for w in ws]


def xla_layers(x, weights):
    """The step's four projections per layer, chained: qkv, then o on its first 2048 columns,
    gate/up, SwiGLU, down; the next layer takes the output."""
    for wqkv, wo, wgu, wd in weights:
        h = jnp.dot(x, wqkv)[:, :HIDDEN]
        h = jnp.dot(h, wo)
        gu = jnp.dot(h, wgu, preferred_element_type=jnp.float32)
        act = (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]).astype(x.dtype)
        x = jnp.dot(act, wd)
    return x


def traces(profile_dir, case, x, ws):
    """`barrier_trace` of each layer of one profiled call of a barriered case."""
    kw = {k: case[k] for k in ("stages", "tile_k", "num_programs", "tail", "chunk") if k in case}
    tag = "_".join(f"{k}{v}" for k, v in sorted(kw.items()))
    directory = os.path.join(profile_dir, f"{case['case']}_rows{case['rows']}_{tag}")
    os.makedirs(directory, exist_ok=True)
    layers = fused_layers if case["case"] == "fused" else ws_layers
    jax.block_until_ready(jax.jit(functools.partial(layers, profile_dir=directory, **kw))(x, ws))
    out = []
    paths = sorted(glob.glob(os.path.join(directory, "*.json")))[-LAYERS:]
    for path in paths:
        trace = dict(case="trace", of=case["case"], rows=case["rows"], **kw)
        trace.update(file=os.path.basename(path), **barrier_trace(path))
        print(json.dumps(trace), flush=True)
        out.append(trace)
    names = [f"barrier{b}" for b in range(len(PHASE_COLS) - 1)] + ["kernel"]
    late = dict(case="lateness", of=case["case"], rows=case["rows"], **kw)
    late.update(lateness([program_spans(path) for path in paths], names))
    print(json.dumps(late), flush=True)
    return out + [late]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--tile-k", type=int, nargs="+", default=[128])
    parser.add_argument("--programs", type=int, nargs="+", default=[None])
    parser.add_argument("--tails", type=float, nargs="+", default=[0.1], help="ws_dynamic")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2], help="ws_dynamic")
    parser.add_argument(
        "--dependent-kb", type=int, nargs="+", default=[32], help="ws_dependent, ws_counters_*"
    )
    parser.add_argument(
        "--cases", nargs="+", default=["fused", "fused_nobarrier", "per_phase", "xla"]
    )
    parser.add_argument("--out")
    parser.add_argument("--profile-dir", help="also trace one call of `fused` per row count")
    args = parser.parse_args()
    keys = map(functools.partial(jax.random.fold_in, jax.random.key(0)), itertools.count())
    dt = jnp.bfloat16
    ws = [jax.random.normal(next(keys), (HIDDEN, sum(PHASE_COLS)), dt) for _ in range(LAYERS)]
    shapes = [(HIDDEN, c) for c in PHASE_COLS]
    wss = [[jax.random.normal(next(keys), s, dt) for s in shapes] for _ in range(LAYERS)]
    xla_shapes = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]
    layer_bytes = HIDDEN * sum(PHASE_COLS) * 2
    cases = []
    for rows in args.rows:
        padded = max(8, -(-rows // 8) * 8)
        x = jax.random.normal(next(keys), (padded, HIDDEN), dt)
        for name in args.cases:
            configs = (
                [dict()]
                if name == "xla"
                else [
                    dict(stages=s, tile_k=t, num_programs=p)
                    for s in args.stages
                    for t in args.tile_k
                    for p in args.programs
                ]
            )
            if "dependent" in name:
                configs = [dict(kw, dependent_kb=d) for kw in configs for d in args.dependent_kb]
            if "counters" in name:
                configs = [dict(kw, counters=True) for kw in configs]
            if name.startswith("ws_dynamic"):
                configs = [
                    dict(kw, tail=tail, chunk=c)
                    for kw in configs
                    for tail in args.tails
                    for c in args.chunks
                ]
            for kw in configs:
                case = dict(case=name, rows=rows, **kw)
                try:
                    if name == "xla":
                        xw = [
                            [jax.random.normal(next(keys), s, dt) for s in xla_shapes]
                            for _ in range(LAYERS)
                        ]
                        fn = jax.jit(xla_layers)
                        args_ = (x[:rows], xw)
                    elif name.startswith("ws"):
                        barriers = not name.endswith("nobarrier")
                        fn = jax.jit(functools.partial(ws_layers, barriers=barriers, **kw))
                        args_ = (x, ws)
                        _, ran = fn(*args_)[0]
                        case["covered"] = covers_every_iteration(ran, HIDDEN // kw["tile_k"])
                    elif name in ("per_phase", "per_phase_pdl"):
                        kw_ = dict(kw, pdl=name == "per_phase_pdl")
                        fn = jax.jit(functools.partial(per_phase_layers, **kw_))
                        args_ = (x, wss)
                    else:
                        fn = jax.jit(
                            functools.partial(fused_layers, barriers=name == "fused", **kw)
                        )
                        args_ = (x, ws)
                    jax.block_until_ready(fn(*args_))
                    if name == "fused":  # a smoke check only: the last tiles came out finite
                        out = fn(*args_)[0]
                        case["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all())
                    us = kernel_time_ms(fn, *args_) * 1e3 / LAYERS
                    # PDL overlaps kernels, so CUPTI's sum of kernel times no longer measures the
                    # chain: its wall time in a graphed loop (as a decode block runs) does.
                    wall = step_time_ms(looped(fn), *args_) * 1e3 / (LOOPS * LAYERS)
                    case["wall_us_per_layer"] = wall
                    case["us_per_layer"] = us
                    case["tb_s"] = layer_bytes / us / 1e6
                except Exception as e:  # noqa: BLE001 - a probe records and goes on
                    case["error"] = error_text(e)
                print(json.dumps(case), flush=True)
                cases.append(case)
                if args.profile_dir and name in ("fused", "ws", "ws_dynamic"):
                    cases += traces(args.profile_dir, case, x, ws)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="layer_stream", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
