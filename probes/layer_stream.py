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
    SwiGLU @ down), each layer's input its predecessor's output.

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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms, step_time_ms
from pallas_kernels.common import device_num_sms
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
            outs = fn(x, ws)
            outs = outs if isinstance(outs, list) else [outs]
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


def barrier_trace(path, sm_ghz=1.98):
    """Per barrier of one profiled call: how far apart the programs arrive (max - min, us),
    how long after the last arrival they leave (median), and how far apart they leave.

    The profiler's timestamps are the program's start on the global timer (ns) plus SM clock
    cycles since then; `sm_ghz` turns the cycles into ns (the clock holds 1980 MHz under
    load, NOTES session 7)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    start, spans = {}, {}
    for e in events:
        if e["name"] == "kernel" and e["ph"] == "B":
            start[e["tid"]] = e["ts"]
    for e in events:
        t0 = start[e["tid"]]
        real = t0 + (e["ts"] - t0) / sm_ghz
        spans.setdefault((e["name"], e["ph"]), []).append(real)
    report = {}
    for name in sorted({n for n, _ in spans}):
        begin, end = sorted(spans[name, "B"]), sorted(spans[name, "E"])
        report[name] = dict(
            programs=len(begin),
            arrive_spread_us=begin[-1] - begin[0],
            leave_after_last_arrival_us=end[len(end) // 2] - begin[-1],
            leave_spread_us=end[-1] - end[0],
            first_arrival_us=begin[0] - min(start.values()),
        )
    return report


def fused_layers(xs, ws, **kw):
    return [stream(xs, w, phase_cols=PHASE_COLS, **kw) for w in ws]


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--tile-k", type=int, nargs="+", default=[128])
    parser.add_argument("--programs", type=int, nargs="+", default=[None])
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
        if args.profile_dir:
            directory = os.path.join(args.profile_dir, f"rows{rows}")
            os.makedirs(directory, exist_ok=True)
            fn = jax.jit(functools.partial(fused_layers, profile_dir=directory))
            jax.block_until_ready(fn(x, ws))
            for path in sorted(glob.glob(os.path.join(directory, "*.json")))[-LAYERS:]:
                trace = dict(case="trace", rows=rows, file=os.path.basename(path))
                trace.update(barrier_trace(path))
                print(json.dumps(trace), flush=True)
                cases.append(trace)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="layer_stream", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
