"""Probe: a decoder layer's work after attention as one persistent Mosaic GPU kernel, with its
arithmetic (issue 20; benchmarks/NOTES.md, "Session 45").

At B=1 the `1b` decode step spends ~40.5 us a layer in eight kernels after the decode kernel
(runs 176, 209): the split merge, o, `add_rms_norm`, gate/up, SwiGLU, down, `add_rms_norm` and
the next layer's qkv. Each pays a ramp and a tail. `layer_stream` streamed the four
projections' weights through one kernel in 26 us a layer, 31 with a grid barrier between
phases (runs 134, 146). This kernel is that stream with the layer's arithmetic in it. One
program per SM; its weight tiles ([128, 64], TMA) come through one pipeline across all four
phases, so the next phase's copies are in flight while a program waits at a barrier:

  - o's programs merge the decode kernel's unmerged split states of their 4 heads (or take
    a merged attention output); phase o: attn [R, Hq*D] @ Wo as float32 partial sums over 4
    parts of K;
  - barrier; each program sums them with the residual x (h = x + o, as `add_rms_norm` does)
    and writes the RMSNorm of h into shared memory as the next phase's x; program 0 keeps h;
  - phase gate/up: normed @ [gate | up], float32 partial sums over parts of K;
  - barrier; each program with a down unit takes SwiGLU of its part of the intermediate
    dimension (the partial sums added, `silu(gate) * up` rounded once, as `models.decoder.MLP`
    does for small steps);
  - phase down: act @ Wd, partial sums over 4 parts of K;
  - barrier; each program takes h2 = h + down and the next layer's input norm of it; program
    0 writes h2, the kernel's first output;
  - phase qkv: normed @ Wqkv (the next layer's), partial sums over 2 parts, the kernel's second
    output (`rope_append` and the Mosaic decode kernel's fold sum such parts).

Work is split into units (a 64-column tile and a part of K), dealt round-robin to the programs
(`Schedule`). The weights come either as a copy in the order the units read them (`arrange`,
streamed by `emit_pipeline` in one warpgroup) or as the model's own matrices, read where they
lie by a copy warpgroup (`direct`, what a model path would use). The barriers count in a ref
that outlives the call (`probes.layer_stream.grid_barrier`), so no memset precedes it.
`simulate` runs the same schedule in NumPy, for the CPU.

Cases, per layer (16 layers, each with its own weights, past the 60 MB L2), CUPTI and the wall
time in a graphed loop:
  - `kernel`: the kernel, each layer's h2 the next one's x (the attention held fixed);
  - `kernel_bare`: the same without the merge, norms and SwiGLU (wrong numbers; what they
    cost), and `kernel_free` without the barriers too (the schedule's weight stream alone);
  - `xla`: the same arithmetic in XLA (`reference`, the split merge first).
Layer 0 is checked against `reference` first, twice, and 16 chained layers against XLA's.
`--profile-dir` traces one call's barriers and prologues in every program (Mosaic GPU's
in-kernel profiler).

    python -m probes.layer_kernel --rows 1 2 --weights arranged direct --out results.json
    python -m probes.layer_kernel --simulate --rows 1 2 --splits 0 10 --weights arranged direct

(`--simulate` also runs `check_schedules`: other shapes, program counts and the last layer.)
"""

from __future__ import annotations

import argparse
import dataclasses
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
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms, step_time_ms
from jaxpaged.layers import rms_norm
from pallas_kernels.common import device_num_sms, merge_splits
from pallas_kernels.mosaic.merge import merge_values
from pallas_kernels.mosaic.pipeline import TILED, tiled_indices
from probes.layer_stream import GRAPH_OPTIONS, barrier_trace, grid_barrier, proxy_fence, select

TILE_N, TILE_K = 64, 128
ROWS = 8  # the padded rows: x is `wgmma`'s N
LAYERS = 16
EPS = 1e-6
RUN = 4  # columns a thread takes at once in the per-thread code
THREADS = 128


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    heads_dim: int = 2048  # Hq * D, o's K
    inter: int = 6144
    qkv: int = 4096  # (Hq + 2 Hkv) * D
    head_dim: int = 128  # D


@dataclasses.dataclass(frozen=True)
class Phase:
    """One projection: K, its output columns (for a `pair` phase the columns of gate alone;
    `direct`'s gate/up has the fused matrix's 2 I), the parts of K its units take, and
    whether a unit is a gate tile and its up tile (`arrange`'s gate/up)."""

    k: int
    cols: int
    parts: int
    pair: bool = False

    @property
    def units(self) -> int:
        return self.cols // TILE_N * self.parts

    @property
    def steps(self) -> int:  # weight tiles a unit reads
        return self.k // TILE_K // self.parts * (2 if self.pair else 1)


def phases(
    shape: Shape, direct: bool = False, num_programs: int = 132, last: bool = False
) -> tuple[Phase, ...]:
    """o, gate/up, down and, unless `last`, qkv. `arrange`'s form is the `1b` shape's: gate/up's
    units a gate tile and its up tile over a quarter of K. `direct`: 64 columns of each of the
    model's matrices (the fused gate/up [hidden, 2 I] in its interleaved columns,
    `models.decoder.split_gate_up`), each phase's parts of K from `choose_parts`."""
    if not direct:
        assert not last
        return (
            Phase(shape.heads_dim, shape.hidden, 4),
            Phase(shape.hidden, shape.inter, 4, pair=True),
            Phase(shape.inter, shape.hidden, 4),
            Phase(shape.hidden, shape.qkv, 2),
        )
    heads = shape.heads_dim // shape.head_dim
    # o's parts are whole heads that one warpgroup merges (4 elements a thread); a program's
    # down units must share their part of K (`Schedule` deals part q to programs q mod parts).
    o_parts = choose_parts(
        shape.heads_dim,
        shape.hidden,
        num_programs,
        ok=lambda d: heads % d == 0 and shape.heads_dim // d <= THREADS * RUN,
    )
    down_parts = choose_parts(
        shape.inter, shape.hidden, num_programs, ok=lambda d: num_programs % d == 0
    )
    layers = [
        Phase(shape.heads_dim, shape.hidden, o_parts),
        Phase(
            shape.hidden, 2 * shape.inter, choose_parts(shape.hidden, 2 * shape.inter, num_programs)
        ),
        Phase(shape.inter, shape.hidden, down_parts),
    ]
    if not last:
        layers.append(
            Phase(shape.hidden, shape.qkv, choose_parts(shape.hidden, shape.qkv, num_programs))
        )
    return tuple(layers)


def choose_parts(k: int, cols: int, num_programs: int, ok=lambda d: True) -> int:
    """The parts of K for a phase of `cols` output columns: the divisor d of its K steps that
    gives the fewest tiles to the busiest program (ceil(units / P) * steps), the fewest parts
    among equals (fewer partial sums to add), among those `ok` allows."""
    k_steps = k // TILE_K
    tiles = cols // TILE_N
    options = [d for d in range(1, k_steps + 1) if k_steps % d == 0 and ok(d)]
    if not options:
        raise ValueError(f"no part count of K={k} fits ({cols} columns, {num_programs} programs)")
    return min(options, key=lambda d: (-(-tiles * d // num_programs) * (k_steps // d), d))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which program runs which unit, in which order, and what each of its iterations reads
    and writes. Unit u of phase j runs on program (u + offsets[j]) % P: gate/up's first units
    go to the programs that o leaves idle (at `1b`, the 4 that o, down and qkv with 128
    units each leave idle). Pure `jnp`, so that the kernel computes it on its scalars and
    `simulate` on arrays of them."""

    shape: Shape
    num_programs: int
    direct: bool = False
    last: bool = False

    @property
    def phases(self) -> tuple[Phase, ...]:
        return phases(self.shape, self.direct, self.num_programs, self.last)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Gate/up starts on the programs after o's units (the ones o leaves idle); the other
        phases on program 0, so that down's part q stays on programs q mod its parts."""
        return (0, self.phases[0].units % self.num_programs, 0, 0)[: len(self.phases)]

    @property
    def bases(self) -> list[int]:  # each phase's first tile in `arrange`'s array
        return list(itertools.accumulate([0] + [p.units * p.steps for p in self.phases]))

    @property
    def max_count(self) -> int:
        """Iterations of the pipeline: the most any program runs, plus one, so that every
        program passes every barrier inside the loop."""
        return sum(-(-p.units // self.num_programs) * p.steps for p in self.phases) + 1

    def plan(self, program):
        """([first unit, units] per phase, each phase's first iteration, then the count)."""
        num = self.num_programs
        info = []
        for j, p in enumerate(self.phases):
            first = (program - self.offsets[j] + num) % num
            count = jnp.maximum((p.units - first + num - 1) // num, 0)
            info.append((first, jnp.where(first < p.units, count, 0)))
        local = [jnp.zeros_like(program)]
        for (_, n), p in zip(info, self.phases, strict=True):
            local.append(local[-1] + n * p.steps)
        return info, local

    def locate(self, i, info, local):
        """For iteration i (clamped to the program's last): its phase, unit, step, the unit's
        part and column tile, the weight tile it reads (a row block of `arrange`'s array, or
        rows `w_k_step` of the phase's own matrix), the 128 columns of the phase's x it
        multiplies (`k_step`), and whether it ends a product (a unit, or a gate/up unit's
        gate half)."""
        ps = self.phases
        count = local[-1]
        i = jnp.clip(i, 0, jnp.maximum(count - 1, 0))
        phase, t = jnp.zeros_like(i), i
        for j in range(1, len(ps)):
            inside = i >= local[j]
            phase = jnp.where(inside, j, phase)
            t = jnp.where(inside, i - local[j], t)
        steps = select([p.steps for p in ps], phase)
        parts = select([p.parts for p in ps], phase)
        half = select([p.steps // 2 if p.pair else p.steps for p in ps], phase)
        first = select([f for f, _ in info], phase)
        unit = first + (t // steps) * self.num_programs
        step = t % steps
        part, tile = unit % parts, unit // parts
        # x holds all of K, except in down, where it holds the program's part of act.
        w_k_step = part * half + step % half
        k_step = jnp.where(phase == 2, step, w_k_step)
        return dict(
            phase=phase,
            unit=unit,
            step=step,
            part=part,
            tile=tile,
            which=(step >= half).astype(jnp.int32),
            k_step=k_step,
            w_k_step=w_k_step,
            tile_row=select(self.bases, phase) + unit * steps + step,
            ends=(step == half - 1) | (step == steps - 1),
        )


def _unit_tiles(w, phase: Phase):
    """w [K, N] -> [units, steps / (2 if pair), 128, 64]: unit (c, part) = c * parts + part
    reads rows part * steps' + s of column tile c."""
    k, n = w.shape
    tiles = w.reshape(k // TILE_K, TILE_K, n // TILE_N, TILE_N).transpose(2, 0, 1, 3)
    per = k // TILE_K // phase.parts
    return tiles.reshape(n // TILE_N * phase.parts, per, TILE_K, TILE_N)


def arrange(wo, w_gate, w_up, wd, wqkv, shape: Shape = Shape()):
    """The layer's weights as one [tiles * 128, 64] array in the order the units read them:
    phase after phase, unit after unit, a gate/up unit's gate tiles before its up tiles."""
    ps = phases(shape)
    blocks = [
        _unit_tiles(wo, ps[0]),
        jnp.concatenate([_unit_tiles(w_gate, ps[1]), _unit_tiles(w_up, ps[1])], axis=1),
        _unit_tiles(wd, ps[2]),
        _unit_tiles(wqkv, ps[3]),
    ]
    return jnp.concatenate([b.reshape(-1, TILE_N) for b in blocks], axis=0)


def _row_norm(
    parts, resid, scale, sum_out, normed_out, warp_sums, row, *, eps, write_sum, smem=True
):
    """Per-thread code of the compute warpgroup for one row: h = resid + rounded(sum of the
    partial sums), rounded, as `jaxpaged.add_rms_norm`; its RMSNorm times `scale` rounded to
    bfloat16 into row `row` of `normed_out`: the next phase's x in shared memory (`TILED`),
    or with `smem` False a GMEM ref (the last layer's output); h into `sum_out` where
    `write_sum`. Runs of 4 columns a thread; runs past the row's end load the last run again
    and store nothing."""

    def kernel(ctx, parts, resid, scale, sum_out, normed_out, warp_sums, row, write_sum):
        del ctx
        num_parts, _, hidden = ir.MemRefType(parts.type).shape
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        bf16 = ir.BF16Type.get()
        vec = lambda t: ir.VectorType.get([RUN], t)  # noqa: E731
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())

        def rounded(v):
            return arith.extf(vec(f32), arith.truncf(vec(bf16), v))

        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))
        runs, loaded = [], []
        for k in range(-(-hidden // (RUN * THREADS))):
            col = arith.muli(arith.addi(tid, c32(k * THREADS)), c32(RUN))
            valid = arith.cmpi(arith.CmpIPredicate.ult, col, c32(hidden))
            col = arith.index_cast(index, arith.minui(col, c32(hidden - RUN)))
            terms = [
                vector.load(vec(f32), parts, [mgpu_utils.c(s, index), r, col])
                for s in range(num_parts)
            ]
            x_run = arith.extf(vec(f32), vector.load(vec(bf16), resid, [r, col]))
            s_run = arith.extf(vec(f32), vector.load(vec(bf16), scale, [col]))
            runs.append((valid, col))
            loaded.append((x_run, terms, s_run))
        totals, squares = [], None
        zero = vector.broadcast(vec(f32), mgpu_utils.c(0.0, f32))
        for (valid, _), (x_run, terms, _) in zip(runs, loaded, strict=True):
            h_run = terms[0]
            for term in terms[1:]:
                h_run = arith.addf(h_run, term)
            total = rounded(arith.addf(x_run, rounded(h_run)))
            totals.append(total)
            square = arith.select(valid, arith.mulf(total, total), zero)
            squares = square if squares is None else arith.addf(squares, square)
        lane = None
        for e in range(RUN):
            item = vector.extract(
                squares, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([e])
            )
            lane = item if lane is None else arith.addf(lane, item)
        warp_total = mgpu_utils.warp_tree_reduce(lane, arith.addf, 32)
        warp = arith.index_cast(index, arith.divui(tid, c32(32)))
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, arith.remui(tid, c32(32)), c32(0))):
            memref.store(warp_total, warp_sums, [warp])
        mgpu_utils.warpgroup_barrier()
        sum_sq = memref.load(warp_sums, [mgpu_utils.c(0, index)])
        for w in range(1, THREADS // 32):
            sum_sq = arith.addf(sum_sq, memref.load(warp_sums, [mgpu_utils.c(w, index)]))
        mgpu_utils.warpgroup_barrier()  # warp_sums is read before the next row writes it
        mean = arith.divf(sum_sq, mgpu_utils.c(float(hidden), f32))
        inv = vector.broadcast(vec(f32), mlir_math.rsqrt(arith.addf(mean, mgpu_utils.c(eps, f32))))
        store_sum = arith.cmpi(arith.CmpIPredicate.ne, write_sum.registers.item(), c32(0))
        for (valid, col), (_, _, s_run), total in zip(runs, loaded, totals, strict=True):
            normed = arith.truncf(vec(bf16), arith.mulf(total, arith.mulf(inv, s_run)))
            with mgpu_utils.when(valid):
                if smem:
                    vector.store(normed, normed_out, tiled_indices(r, col))
                else:
                    vector.store(normed, normed_out, [r, col])
            with mgpu_utils.when(arith.andi(valid, store_sum)):
                vector.store(arith.truncf(vec(bf16), total), sum_out, [r, col])

    refs = (plgpu.RefType(),) * 4
    out_type = plgpu.RefType(TILED) if smem else plgpu.RefType()
    splat = plgpu.Layout.WG_SPLAT(shape=())
    plgpu.inline_mgpu(arg_types=(*refs, out_type, plgpu.RefType(), splat, splat))(kernel)(
        parts, resid, scale, sum_out, normed_out, warp_sums, row, write_sum
    )


def _row_swiglu(gate_up, x_smem, row, part, *, width, pairs):
    """Per-thread code for one row: SwiGLU of columns [part * width, (part + 1) * width) of the
    intermediate dimension, gate and up each the sum of their partial sums, rounded to
    bfloat16 into `x_smem` columns [0, width). `gate_up`: f32[S, R, 2, I] (gate, then up), or
    with `pairs` the model's fused columns f32[S, R, 2 I] (gate j at 2 j, up j at 2 j + 1),
    of which a thread loads 8 adjacent ones for its 4."""

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(TILED),
            plgpu.Layout.WG_SPLAT(shape=()),
            plgpu.Layout.WG_SPLAT(shape=()),
        )
    )
    def rows(ctx, gate_up, x_smem, row, part):
        del ctx
        num_parts = ir.MemRefType(gate_up.type).shape[0]
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        bf16 = ir.BF16Type.get()
        vec, wide = ir.VectorType.get([RUN], f32), ir.VectorType.get([2 * RUN], f32)
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())
        base = arith.muli(part.registers.item(), c32(width))
        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))

        def summed(load):
            total = load(0)
            for s in range(1, num_parts):
                total = arith.addf(total, load(s))
            return total

        runs = []
        for k in range(-(-width // (RUN * THREADS))):
            local = arith.muli(arith.addi(tid, c32(k * THREADS)), c32(RUN))
            valid = arith.cmpi(arith.CmpIPredicate.ult, local, c32(width))
            local = arith.minui(local, c32(width - RUN))
            col = arith.addi(base, local)
            if pairs:
                col = arith.index_cast(index, arith.muli(col, c32(2)))
                total = summed(
                    lambda s, col=col: vector.load(wide, gate_up, [mgpu_utils.c(s, index), r, col])
                )
                gate = vector.shuffle(total, total, [0, 2, 4, 6])
                up = vector.shuffle(total, total, [1, 3, 5, 7])
            else:
                col = arith.index_cast(index, col)
                gate, up = (
                    summed(
                        lambda s, col=col, which=which: vector.load(
                            vec,
                            gate_up,
                            [mgpu_utils.c(s, index), r, mgpu_utils.c(which, index), col],
                        )
                    )
                    for which in range(2)
                )
            runs.append((valid, local, gate, up))
        one = vector.broadcast(vec, mgpu_utils.c(1.0, f32))
        for valid, local, gate, up in runs:
            sig = arith.divf(one, arith.addf(one, mlir_math.exp(arith.negf(gate))))
            act = arith.truncf(
                ir.VectorType.get([RUN], bf16), arith.mulf(arith.mulf(gate, sig), up)
            )
            with mgpu_utils.when(valid):
                vector.store(act, x_smem, tiled_indices(r, arith.index_cast(index, local)))

    rows(gate_up, x_smem, row, part)


def _row_merge(outs, lses, x_smem, row, part, *, heads_per_part):
    """Per-thread code for one row: the split-KV merge of the `heads_per_part` heads of o's K
    part `part` (`pallas_kernels.mosaic.merge.merge_values`), from the decode kernel's
    unmerged states (`outs` f32[R, splits, Hq, D], `lses` f32[R, splits, Hq]), rounded to
    bfloat16 into `x_smem` columns [part * heads_per_part * D, ...). A thread takes 4
    elements of one head; threads past the part's heads take none."""

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(TILED),
            plgpu.Layout.WG_SPLAT(shape=()),
            plgpu.Layout.WG_SPLAT(shape=()),
        )
    )
    def rows(ctx, outs, lses, x_smem, row, part):
        del ctx
        _, num_splits, _, head_dim = ir.MemRefType(outs.type).shape
        i32, index, f32 = ir.IntegerType.get_signless(32), ir.IndexType.get(), ir.F32Type.get()
        c32 = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
        r = arith.index_cast(index, row.registers.item())
        tid = arith.remui(mgpu_utils.thread_idx(), c32(THREADS))
        threads_per_head = head_dim // RUN
        active = heads_per_part * threads_per_head
        takes = arith.cmpi(arith.CmpIPredicate.ult, tid, c32(active))
        tid = arith.minui(tid, c32(active - 1))
        local_head = arith.divui(tid, c32(threads_per_head))
        head = arith.addi(arith.muli(part.registers.item(), c32(heads_per_part)), local_head)
        col = arith.muli(arith.remui(tid, c32(threads_per_head)), c32(RUN))
        head_i, col_i = arith.index_cast(index, head), arith.index_cast(index, col)
        splits = [mgpu_utils.c(s, index) for s in range(num_splits)]
        split_lses = [memref.load(lses, [r, s, head_i]) for s in splits]
        values = [
            vector.load(ir.VectorType.get([RUN], f32), outs, [r, s, head_i, col_i]) for s in splits
        ]
        merged, _ = merge_values(split_lses, values)
        merged = arith.truncf(ir.VectorType.get([RUN], ir.BF16Type.get()), merged)
        x_col = arith.addi(arith.muli(head, c32(head_dim)), col)
        with mgpu_utils.when(takes):
            vector.store(merged, x_smem, tiled_indices(r, arith.index_cast(index, x_col)))

    rows(outs, lses, x_smem, row, part)


def _store_transposed(acc, y_smem):
    """y_smem [R, 64] = acc.T for a float32 `wgmma` accumulator [64, R]: per-thread scalar
    stores (4 a thread at R = 8), since Pallas' transposed store of it fails Mosaic GPU's
    layout inference (the bfloat16 one, which `layer_stream` uses, does not)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, acc, y_smem):
        del ctx
        acc.foreach(lambda value, idx: memref.store(value, y_smem, [idx[1], idx[0]]))

    store(acc, y_smem)


def layer(
    attn,
    x,
    w,
    scale_mlp,
    scale_next,
    counters,
    *,
    parity,
    real_rows=ROWS,
    stages=4,
    prologues=True,
    barriers=True,
    profile_dir=None,
    shape=Shape(),
):
    """One layer after attention. attn [R, Hq*D] and x [R, hidden] bfloat16 (R = `ROWS`; rows
    at or past the real ones zero in attn), or attn the decode kernel's unmerged states
    (f32[R, splits, Hq, D] outputs, f32[R, splits, Hq] LSEs), which o's programs merge
    themselves. w: from `arrange` (one array, streamed by `emit_pipeline` in one warpgroup),
    or the model's own matrices (wo [Hq*D, hidden], the fused gate/up [hidden, 2 I], wd [I,
    hidden], the next layer's wqkv [hidden, qkv]), read where they lie by a copy warpgroup
    beside the compute warpgroup ("direct"). The two norms' scales [hidden]; `counters` a
    `jax.new_ref` of [3, 3] int32 (see `probes.layer_stream.stream_ws`). The norms and SwiGLU
    run for the first `real_rows` rows only (the rest stay zero in the next phase's x).
    Returns h2 [R, hidden] bfloat16 (the residual after the MLP; rows past `real_rows`
    undefined) and the next layer's qkv as float32 partial sums [parts, R, qkv]. The last
    layer passes (wo, gate/up, wd) only, and `scale_next` is the final norm's: it returns h2
    and the final norm of it [R, hidden], which program 0 takes after a last barrier.

    Diagnostics: without `prologues` the programs skip the merge, the norms and SwiGLU, and
    without `barriers` the grid barriers too (wrong numbers both, what they cost);
    `profile_dir` traces each program's "kernel", "barrier{b}" and "prologue{j}" regions
    (Mosaic GPU's in-kernel profiler, `barrier_trace` reads them)."""
    direct = isinstance(w, tuple)
    last = direct and len(w) == 3
    states = attn if isinstance(attn, tuple) else ()
    if states:  # the rows past the real ones come from zeros, the real ones from the merge
        assert states[0].shape[2:] == (shape.heads_dim // shape.head_dim, shape.head_dim)
        attn = jnp.zeros((states[0].shape[0], shape.heads_dim), x.dtype)
    rows = attn.shape[0]
    assert rows == ROWS and attn.shape[1] == shape.heads_dim and x.shape == (rows, shape.hidden)
    num_programs = device_num_sms()
    sched = Schedule(shape, num_programs, direct, last)
    ps = sched.phases
    # x's shared memory holds one part of the intermediate dimension in the down phase: a
    # program's down units share it (`choose_parts`; at `1b` one unit a program).
    if direct:
        assert num_programs % ps[2].parts == 0
    else:
        assert ps[2].units <= num_programs and min(p.units for p in ps) >= num_programs - 4
    assert shape.heads_dim // ps[0].parts <= THREADS * RUN  # o's merge: one warpgroup a part
    f32 = jnp.float32
    width = shape.inter // ps[2].parts
    x_cols = max(shape.heads_dim, shape.hidden, width)
    weights = w if direct else (w,)

    def body(attn_ref, x_ref, s_mlp_ref, s_next_ref, counters_ref, *refs):
        w_refs, refs = refs[: len(weights)], refs[len(weights) :]
        state_refs, refs = refs[: len(states)], refs[len(states) :]
        h2_ref, qkv_ref, o_ref, gu_ref, d_ref, h_ref, *scratch = refs  # last: qkv_ref the norm
        x_smem, y_smem, warp_sums, a_barrier, pipe = scratch
        program = lax.axis_index("program")
        info, local = sched.plan(program)
        count = local[-1]

        def prologue(j):
            """What a program does after barrier j - 1, before phase j's first product."""
            if not prologues:
                return
            if j == 1 or j == 3:
                scale = s_mlp_ref if j == 1 else s_next_ref
                parts, resid = (o_ref, x_ref) if j == 1 else (d_ref, h_ref)
                out = h_ref if j == 1 else h2_ref
                for r in range(real_rows):
                    _row_norm(
                        parts,
                        resid,
                        scale,
                        out,
                        x_smem,
                        warp_sums,
                        jnp.int32(r),
                        eps=EPS,
                        write_sum=(program == 0).astype(jnp.int32),
                    )
            else:
                first, n = info[2]

                @pl.when(n > 0)
                def _():
                    for r in range(real_rows):
                        _row_swiglu(
                            gu_ref,
                            x_smem,
                            jnp.int32(r),
                            lax.rem(first, ps[2].parts),
                            width=width,
                            pairs=direct,
                        )

            plgpu.commit_smem()

        def step(i, w_tile, acc, wait_tile=None):
            """Iteration i: its barriers and prologues first, then its product with the
            weight tile `w_tile` [128, 64] (after `wait_tile()`), and its store if it ends
            a product. Returns the accumulator, zeroed where a product ended."""
            live = i < count

            @pl.when(i == 0)
            def _():
                plgpu.barrier_wait(a_barrier)
                first, n = info[0]
                if states and prologues:

                    @pl.when(n > 0)
                    @jax.named_scope("prologue0")
                    def _():
                        part = lax.rem(first, ps[0].parts)
                        for r in range(real_rows):
                            _row_merge(
                                *state_refs,
                                x_smem,
                                jnp.int32(r),
                                part,
                                heads_per_part=shape.heads_dim // shape.head_dim // ps[0].parts,
                            )
                        plgpu.commit_smem()

            for b in range(len(ps) - 1):

                @pl.when(i == local[b + 1])
                def _(b=b):
                    if barriers:
                        with jax.named_scope(f"barrier{b}"):
                            plgpu.wait_smem_to_gmem(0)
                            proxy_fence()
                            grid_barrier(counters_ref, parity, b, num_programs)
                            proxy_fence()
                    with jax.named_scope(f"prologue{b + 1}"):
                        prologue(b + 1)

            at = sched.locate(i, info, local)
            phase, part, tile = at["phase"], at["part"], at["tile"]
            col = pl.multiple_of(at["k_step"] * TILE_K, TILE_K)
            row = plgpu.broadcasted_iota(jnp.int32, (TILE_N, rows), 0, layout=plgpu.Layout.WGMMA)
            if wait_tile is not None:
                pl.when(live)(wait_tile)

            def mma(acc_ref):
                plgpu.wgmma(acc_ref, w_tile.T, x_smem.at[:, pl.ds(col, TILE_K)].T)

            acc = jnp.where(
                row < jnp.where(live, TILE_N, 0), pl.run_state(mma)(plgpu.ACC.init(acc)), acc
            )
            ends = live & at["ends"]

            @pl.when(ends)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                _store_transposed(acc, y_smem)
                plgpu.commit_smem()
                cols = pl.ds(tile * TILE_N, TILE_N)
                dests = (o_ref, gu_ref if direct else None, d_ref, qkv_ref)[: len(ps)]
                for j, dest in enumerate(dests):
                    if dest is not None:
                        pl.when(phase == j)(
                            lambda dest=dest: plgpu.copy_smem_to_gmem(
                                y_smem, dest.at[part, :, cols]
                            )
                        )
                if not direct:
                    pl.when(phase == 1)(
                        lambda: plgpu.copy_smem_to_gmem(
                            y_smem, gu_ref.at[part, :, at["which"], cols]
                        )
                    )

            return jnp.where(row < jnp.where(ends, 0, TILE_N), acc, jnp.zeros_like(acc))

        def start():
            @pl.when(program == 0)
            def _():
                for b in range(len(ps) - 1):
                    counters_ref[1 - parity, b] = jnp.int32(0)

            # The attention output comes in beside the first weight tiles; o's first product
            # waits for it.
            plgpu.copy_gmem_to_smem(attn_ref, x_smem.at[:, pl.ds(0, shape.heads_dim)], a_barrier)
            return plgpu.layout_cast(jnp.zeros((TILE_N, rows), f32), plgpu.Layout.WGMMA)

        if not direct:
            zero = start()
            with jax.named_scope("kernel"):
                plgpu.emit_pipeline(
                    lambda indices, w_tile, acc: step(indices[0], w_tile, acc),
                    grid=(sched.max_count,),
                    in_specs=[
                        plgpu.BlockSpec(
                            (TILE_K, TILE_N),
                            lambda i: (sched.locate(i, info, local)["tile_row"], 0),
                            transforms=TILED,
                        )
                    ],
                    max_concurrent_steps=stages,
                    init_carry=zero,
                )(w_refs[0])
            plgpu.wait_smem_to_gmem(0)
            return

        w_smem, (ready, free) = pipe
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _copies():
            def copy(i, carry):
                slot = lax.rem(i, stages)
                pl.when(i >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                at = sched.locate(i, info, local)
                k_rows = pl.ds(pl.multiple_of(at["w_k_step"] * TILE_K, TILE_K), TILE_K)
                cols = pl.ds(pl.multiple_of(at["tile"] * TILE_N, TILE_N), TILE_N)
                for j, w_ref in enumerate(w_refs):
                    pl.when(at["phase"] == j)(
                        lambda w_ref=w_ref: plgpu.copy_gmem_to_smem(
                            w_ref.at[k_rows, cols], w_smem.at[slot], ready.at[slot]
                        )
                    )
                return carry

            lax.fori_loop(0, count, copy, jnp.int32(0))

        @pl.when(wg == 0)
        def _compute():
            zero = start()

            def compute(i, acc):
                slot = lax.rem(i, stages)
                acc = step(
                    i,
                    w_smem.at[slot],
                    acc,
                    wait_tile=lambda: plgpu.barrier_wait(ready.at[slot]),
                )
                pl.when(i < count)(lambda: plgpu.barrier_arrive(free.at[slot]))
                return acc

            with jax.named_scope("kernel"):
                lax.fori_loop(0, sched.max_count, compute, zero)
            if last:  # every down product stored; program 0 takes h2 and the final norm
                plgpu.wait_smem_to_gmem(0)
                proxy_fence()
                grid_barrier(counters_ref, parity, len(ps) - 1, num_programs)

                @pl.when(program == 0)
                def _():
                    for r in range(real_rows):
                        _row_norm(
                            d_ref,
                            h_ref,
                            s_next_ref,
                            h2_ref,
                            qkv_ref,
                            warp_sums,
                            jnp.int32(r),
                            eps=EPS,
                            write_sum=jnp.int32(1),
                            smem=False,
                        )

            plgpu.wait_smem_to_gmem(0)

    gu_shape = (rows, 2 * shape.inter) if direct else (rows, 2, shape.inter)
    out_types = (
        jax.ShapeDtypeStruct((rows, shape.hidden), x.dtype),
        jax.ShapeDtypeStruct((rows, shape.hidden), x.dtype)
        if last
        else jax.ShapeDtypeStruct((ps[3].parts, rows, shape.qkv), f32),
        jax.ShapeDtypeStruct((ps[0].parts, rows, shape.hidden), f32),
        jax.ShapeDtypeStruct((ps[1].parts, *gu_shape), f32),
        jax.ShapeDtypeStruct((ps[2].parts, rows, shape.hidden), f32),
        jax.ShapeDtypeStruct((rows, shape.hidden), x.dtype),
    )
    pipe = (
        (
            plgpu.SMEM((stages, TILE_K, TILE_N), x.dtype, transforms=TILED),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        )
        if direct
        else ()
    )
    h2, qkv, *_ = plgpu.kernel(
        body,
        out_type=out_types,
        grid=(num_programs,),
        grid_names=("program",),
        scratch_types=(
            plgpu.SMEM((rows, x_cols), x.dtype, transforms=TILED),
            plgpu.SMEM((rows, TILE_N), f32),
            plgpu.SMEM((THREADS // 32,), f32),
            plgpu.Barrier(),
            pipe,
        ),
        kernel_name="layer_kernel",
        compiler_params=plgpu.CompilerParams(
            **(dict(profile_space=64, profile_dir=profile_dir) if profile_dir else {})
        ),
        **(dict(num_threads=2, thread_name="wg") if direct else {}),
    )(attn, x, scale_mlp, scale_next, counters, *weights, *states)
    return h2, qkv


def simulate(attn, x, w, scale_mlp, scale_next, *, num_programs, real_rows, shape=Shape()):
    """The kernel's work, as `Schedule` deals it, in NumPy (float32 products of the bfloat16
    tiles; the norms and SwiGLU as the per-thread code computes them): what the CPU can check
    of the kernel's index arithmetic, its weight order (`arrange`, or the model's matrices
    with `w` a tuple, as `layer` takes them) and its stores. Raises if an output element is
    written twice or not at all, or if a program's down units need parts of act other than
    the one its prologue takes. Returns (h2, qkv partial sums), or for the last layer (h2,
    the final norm), as `layer` does, for the first `real_rows` rows."""
    direct = isinstance(w, tuple)
    last = direct and len(w) == 3
    sched = Schedule(shape, num_programs, direct, last)
    ps = sched.phases
    if direct:
        mats = [np.asarray(m, np.float32) for m in w]

        def tile_of(prog, i):
            k, c = at["w_k_step"][prog, i] * TILE_K, at["tile"][prog, i] * TILE_N
            return mats[at["phase"][prog, i]][k : k + TILE_K, c : c + TILE_N]
    else:
        tiles = np.asarray(w, np.float32).reshape(-1, TILE_K, TILE_N)

        def tile_of(prog, i):
            return tiles[at["tile_row"][prog, i]]

    programs = jnp.arange(num_programs)
    info, local = sched.plan(programs)
    its = jnp.arange(sched.max_count)
    at = sched.locate(
        its[None, :], [(f[:, None], n[:, None]) for f, n in info], [v[:, None] for v in local]
    )
    at = {k: np.asarray(v) for k, v in at.items()}
    live = np.asarray(its[None, :] < local[-1][:, None])
    f32 = np.float32
    rows = real_rows

    def bf16(v):
        return np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))

    def norm(h, scale):
        inv = 1 / np.sqrt((h * h).mean(-1, keepdims=True) + EPS)
        return bf16(h * (inv * np.asarray(scale, f32)))

    outs = [np.zeros((p.parts, rows, 2 if p.pair else 1, p.cols), f32) for p in ps]
    written = [np.zeros(o.shape, np.int32) for o in outs]
    xs = {}  # the phase's x a program multiplies (down: its part of act)
    xs[0] = np.asarray(attn, f32)[:rows]
    for j, p in enumerate(ps):
        if j == 1:
            o = bf16(outs[0].sum(0)[:, 0])
            h = bf16(np.asarray(x, f32)[:rows] + o)
            xs[1] = norm(h, scale_mlp)
        if j == 3:
            d = bf16(outs[2].sum(0)[:, 0])
            h2 = bf16(h + d)
            xs[3] = norm(h2, scale_next)
        if j == 2:
            if direct:  # the fused columns: gate j at 2 j, up j at 2 j + 1
                gate, up = outs[1].sum(0)[:, 0, 0::2], outs[1].sum(0)[:, 0, 1::2]
            else:
                gate, up = outs[1].sum(0)[:, 0], outs[1].sum(0)[:, 1]
            act = bf16(gate / (1 + np.exp(-gate)) * up)
        for prog in range(num_programs):
            acc = np.zeros((rows, TILE_N), f32)
            for i in np.nonzero(live[prog] & (at["phase"][prog] == j))[0]:
                k = at["k_step"][prog, i] * TILE_K
                if j == 2:  # the part of act the prologue took: its first unit's
                    width = shape.inter // p.parts
                    part = int(info[2][0][prog]) % p.parts
                    if at["part"][prog, i] != part:
                        raise AssertionError(f"program {prog}'s down units span parts of act")
                    xj = act[:, part * width : (part + 1) * width]
                else:
                    xj = xs[j]
                acc += xj[:, k : k + TILE_K] @ tile_of(prog, i)
                if at["ends"][prog, i]:
                    part, tile, which = (at[n][prog, i] for n in ("part", "tile", "which"))
                    cols = slice(tile * TILE_N, (tile + 1) * TILE_N)
                    outs[j][part, :, which if p.pair else 0, cols] = acc
                    written[j][part, :, which if p.pair else 0, cols] += 1
                    acc = np.zeros_like(acc)
    for j, n in enumerate(written):
        if not (n == 1).all():
            raise AssertionError(f"phase {j}: outputs written {np.unique(n)} times")
    if last:
        h2 = bf16(h + bf16(outs[2].sum(0)[:, 0]))
        return h2, norm(h2, scale_next)
    return h2, outs[3][:, :, 0]


def reference(attn, x, wo, w_gate, w_up, wd, wqkv, scale_mlp, scale_next, *, eps=EPS):
    """The same layer as the decode step computes it (`jaxpaged.add_rms_norm`,
    `models.decoder.MLP` for small steps), in XLA: returns h2 and qkv (summed, float32), or
    with `wqkv` None (the last layer) h2 and its final norm."""

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    h = x + dot(attn, wo).astype(x.dtype)
    normed = rms_norm(h, scale_mlp, eps)
    act = (jax.nn.silu(dot(normed, w_gate)) * dot(normed, w_up)).astype(x.dtype)
    h2 = h + dot(act, wd).astype(x.dtype)
    normed = rms_norm(h2, scale_next, eps)
    return h2, normed if wqkv is None else dot(normed, wqkv)


def looped(fn, loops=10):
    """`fn(x, state)` `loops` times in one while loop in one command buffer, each repeat's x
    its predecessor's output (as `probes.layer_stream.looped`)."""

    def run(x, state):
        return lax.fori_loop(0, loops, lambda _, x: fn(x, state), x)

    return jax.jit(run, compiler_options=GRAPH_OPTIONS)


def check_layer(attn, x, w, scales, *, real_rows):
    """One layer; also how many programs gave up on each barrier (`grid_barrier`)."""
    counters = jax.new_ref(jnp.zeros((3, 3), jnp.int32))
    h2, second = layer(attn, x, w, *scales, counters, parity=0, real_rows=real_rows)
    return h2, second, counters[2]


def kernel_layers(x, state, **kw):
    """The layers chained, each one's h2 the next one's x (rows past `real_rows` undefined);
    `kw` as `layer`'s."""
    attn, arranged, scales = state
    counters = jax.new_ref(jnp.zeros((3, 3), jnp.int32))
    for n, (w, (s_mlp, s_next)) in enumerate(zip(arranged, scales, strict=True)):
        x, _ = layer(attn, x, w, s_mlp, s_next, counters, parity=n % 2, **kw)
    return x


def merged(attn, real_rows):
    """attn [R, Hq*D] bfloat16, or unmerged states merged as the decode step merges them,
    rows past `real_rows` zero."""
    if isinstance(attn, tuple):
        outs, lses = attn
        out, _ = merge_splits(outs, lses, out_dtype=jnp.bfloat16)  # [R, Hq, D]
        attn = out.reshape(out.shape[0], -1)
    keep = jnp.arange(attn.shape[0])[:, None] < real_rows
    return jnp.where(keep, attn, 0).astype(jnp.bfloat16)


def xla_layers(x, state, real_rows=ROWS):
    """`reference` over the layers, each with the split merge first where attn is unmerged
    (made to depend on the layer's x, so that XLA merges once a layer, as the step does)."""
    states, raw, scales = state
    for (wo, wg, wu, wd, wqkv), (s_mlp, s_next) in zip(raw, scales, strict=True):
        attn = states
        if isinstance(states, tuple):
            outs, lses = states
            attn = (outs, lses + 0 * x[0, 0].astype(lses.dtype))
        attn = merged(attn, real_rows)[: x.shape[0]]
        x, _ = reference(attn, x, wo, wg, wu, wd, wqkv, s_mlp, s_next)
    return x


def traced(profile_dir, real, x, state):
    """One profiled call of the 16 chained layers: per named region, the medians over the
    layers of `barrier_trace`'s figures."""
    directory = os.path.join(profile_dir, f"rows{real}")
    os.makedirs(directory, exist_ok=True)
    summary = dict(case="trace", rows=real)
    try:
        fn = jax.jit(functools.partial(kernel_layers, real_rows=real, profile_dir=directory))
        jax.block_until_ready(fn(x, state))
        reports = [
            barrier_trace(path)
            for path in sorted(glob.glob(os.path.join(directory, "*.json")))[-LAYERS:]
        ]
        for name in reports[0]:
            for key in reports[0][name]:
                values = sorted(r[name][key] for r in reports if r[name][key] is not None)
                if values:
                    summary[f"{name}.{key}"] = values[len(values) // 2]
    except Exception as e:  # noqa: BLE001 - a probe records and goes on
        summary["error"] = error_text(e)
    print(json.dumps(summary), flush=True)
    return summary


def check_schedules(seed=0):
    """`simulate` against `reference` for `direct` weights over other shapes, program counts
    and the last layer's form: what a model path would run (a CPU check)."""
    rng = np.random.default_rng(seed)

    def normal(shape_, scale):
        return jnp.asarray(rng.standard_normal(shape_) * scale, jnp.float32).astype(jnp.bfloat16)

    tiny, mid, wide = (
        Shape(128, 256, 256, 512, 64),
        Shape(256, 512, 768, 1024, 64),
        Shape(512, 512, 1536, 768),
    )
    cases = [(Shape(), 132, False, 1), (Shape(), 132, True, 1), (tiny, 132, False, 2),
             (tiny, 8, True, 1), (mid, 16, False, 3), (mid, 12, True, 2), (mid, 5, False, 1),
             (mid, 7, True, 1), (wide, 132, False, 1), (wide, 6, True, 8)]  # fmt: skip
    out = []
    for shape, programs, last, rows in cases:
        wo = normal((shape.heads_dim, shape.hidden), shape.heads_dim**-0.5)
        wg, wu = (normal((shape.hidden, shape.inter), shape.hidden**-0.5) for _ in range(2))
        wd = normal((shape.inter, shape.hidden), shape.inter**-0.5)
        wqkv = None if last else normal((shape.hidden, shape.qkv), shape.hidden**-0.5)
        scales = (1 + normal((shape.hidden,), 0.1), 1 + normal((shape.hidden,), 0.1))
        attn, x = normal((ROWS, shape.heads_dim), 1.0), normal((ROWS, shape.hidden), 1.0)
        fused = jnp.stack([wg, wu], -1).reshape(shape.hidden, -1)
        w = (wo, fused, wd) if last else (wo, fused, wd, wqkv)
        case = dict(case="schedule", shape=dataclasses.astuple(shape), programs=programs)
        case.update(last=last, rows=rows)
        case["parts"] = [p.parts for p in phases(shape, True, programs, last)]
        try:
            h2, second = simulate(
                attn, x, w, *scales, num_programs=programs, real_rows=rows, shape=shape
            )
            want_h2, want = reference(attn[:rows], x[:rows], wo, wg, wu, wd, wqkv, *scales)
            second = second if last else second.sum(0)
            for name, got, ref in (("h2", h2, want_h2), ("out", second, want)):
                got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
                case[f"{name}_rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
        except Exception as e:  # noqa: BLE001 - a probe records and goes on
            case["error"] = error_text(e)
        print(json.dumps(case), flush=True)
        out.append(case)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument(
        "--simulate", action="store_true", help="only `simulate` against `reference` (a CPU)"
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["kernel", "kernel_bare", "kernel_free", "xla"],
        help="timed cases",
    )
    parser.add_argument(
        "--splits",
        type=int,
        nargs="+",
        default=[10],
        help="the attention output as that many unmerged splits (0: merged, bfloat16)",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["arranged"],
        choices=["arranged", "direct"],
        help="`arrange`'s copy through `emit_pipeline`, or the model's matrices where they lie",
    )
    parser.add_argument("--profile-dir", help="also trace one call of the kernel per case")
    parser.add_argument("--out")
    args = parser.parse_args()
    shape = Shape()
    keys = map(functools.partial(jax.random.fold_in, jax.random.key(0)), itertools.count())
    dt = jnp.bfloat16

    def normal(shape_, scale):
        return (jax.random.normal(next(keys), shape_, jnp.float32) * scale).astype(dt)

    def rel_err(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if not np.isfinite(got).all():
            return float("nan")
        return float(np.abs(got - want).max() / np.abs(want).max())

    layers = 1 if args.simulate else LAYERS
    raw = [
        (
            normal((shape.heads_dim, shape.hidden), shape.heads_dim**-0.5),
            normal((shape.hidden, shape.inter), shape.hidden**-0.5),
            normal((shape.hidden, shape.inter), shape.hidden**-0.5),
            normal((shape.inter, shape.hidden), shape.inter**-0.5),
            normal((shape.hidden, shape.qkv), shape.hidden**-0.5),
        )
        for _ in range(layers)
    ]
    scales = [(1 + normal((shape.hidden,), 0.1), 1 + normal((shape.hidden,), 0.1)) for _ in raw]
    kernel_weights = {
        "arranged": lambda: [jax.jit(arrange)(*w) for w in raw],
        "direct": lambda: [
            (wo, jnp.stack([wg, wu], -1).reshape(wg.shape[0], -1), wd, wqkv)
            for wo, wg, wu, wd, wqkv in raw
        ],
    }
    cases = []
    for weights, real, splits in itertools.product(args.weights, args.rows, args.splits):
        arranged = kernel_weights[weights]()
        x = jnp.zeros((ROWS, shape.hidden), dt).at[:real].set(normal((real, shape.hidden), 1.0))
        if splits:  # the decode kernel's unmerged states; rows past the real ones unused
            heads = shape.heads_dim // shape.head_dim
            outs = normal((ROWS, splits, heads, shape.head_dim), 1.0).astype(jnp.float32)
            lses = 3 * normal((ROWS, splits, heads), 1.0).astype(jnp.float32)
            attn_in = (outs, lses)
        else:
            attn_in = normal((ROWS, shape.heads_dim), 1.0)
        attn = merged(attn_in, real)
        want_h2, want_qkv = reference(attn[:real], x[:real], *raw[0], *scales[0])
        check = dict(
            case="simulate" if args.simulate else "check", weights=weights, rows=real, splits=splits
        )
        try:
            if args.simulate:
                h2, qkv = simulate(
                    attn, x, arranged[0], *scales[0], num_programs=132, real_rows=real
                )
            else:
                fn = jax.jit(functools.partial(check_layer, real_rows=real))
                h2, qkv, failed = fn(attn_in, x, arranged[0], scales[0])
                check["barrier_give_ups"] = np.asarray(failed).tolist()
                again = fn(attn_in, x, arranged[0], scales[0])
                check["repeat_equal"] = bool(
                    (np.asarray(again[1]) == np.asarray(qkv)).all()
                    and (np.asarray(again[0]) == np.asarray(h2)).all()
                )
            # bfloat16 outputs: a few ulps of rounding apart (sums in another order).
            check["h2_rel_err"] = rel_err(h2[:real], want_h2)
            check["qkv_rel_err"] = rel_err(np.asarray(qkv).sum(0)[:real], want_qkv)
            if not args.simulate:  # 16 layers chained, both ways: their drift apart
                got = jax.jit(functools.partial(kernel_layers, real_rows=real))(
                    x, (attn_in, arranged, scales)
                )
                want = jax.jit(functools.partial(xla_layers, real_rows=real))(
                    x[:real], (attn_in, raw, scales)
                )
                check["chain_rel_err"] = rel_err(got[:real], want)
        except Exception as e:  # noqa: BLE001 - a probe records and goes on
            check["error"] = error_text(e)
        print(json.dumps(check), flush=True)
        cases.append(check)
        if args.simulate:
            continue
        runs = [
            (name, stages if name != "xla" else None)
            for name in args.cases
            for stages in (args.stages if name != "xla" else [None])
        ]
        for name, stages in runs:
            case = dict(case=name, weights=weights, rows=real, splits=splits, stages=stages)
            try:
                if name == "xla":
                    fn = jax.jit(functools.partial(xla_layers, real_rows=real))
                    args_ = (x[:real], (attn_in, raw, scales))
                else:
                    kw = dict(
                        real_rows=real,
                        stages=stages,
                        prologues=name == "kernel",
                        barriers=name != "kernel_free",
                    )
                    fn = jax.jit(functools.partial(kernel_layers, **kw))
                    args_ = (x, (attn_in, arranged, scales))
                jax.block_until_ready(fn(*args_))
                case["us_per_layer"] = kernel_time_ms(fn, *args_) * 1e3 / LAYERS
                case["wall_us_per_layer"] = step_time_ms(looped(fn), *args_) * 1e3 / (10 * LAYERS)
            except Exception as e:  # noqa: BLE001 - a probe records and goes on
                case["error"] = error_text(e)
            print(json.dumps(case), flush=True)
            cases.append(case)
        if args.profile_dir:
            trace = traced(args.profile_dir, real, x, (attn_in, arranged, scales))
            cases.append(dict(trace, weights=weights, splits=splits))
    if args.simulate:
        cases += check_schedules()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="layer_kernel", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
