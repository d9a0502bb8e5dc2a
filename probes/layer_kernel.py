"""Probe: the persistent layer kernel (`pallas_kernels.mosaic.layer`: a decoder layer's work
after attention in one Mosaic GPU kernel), measured, and its schedule run in NumPy (issue 20;
benchmarks/NOTES.md, sessions 45-46).

At B=1 the `1b` decode step spends ~40.5 us a layer in eight kernels after the decode kernel
(runs 176, 209): the split merge, o, `add_rms_norm`, gate/up, SwiGLU, down, `add_rms_norm` and
the next layer's qkv. `layer_stream` streamed the four projections' weights through one kernel
in 26 us a layer, 31 with a grid barrier between phases (runs 134, 146); the layer kernel is
that stream with the layer's arithmetic in it (its module docstring has the phases).

Its weights come either as the model's own matrices (`direct`, what the model path runs) or
as a copy in the order the units read them (`arrange` here, streamed by `emit_pipeline`).
`simulate` runs the kernel's `Schedule` in NumPy, for the CPU.

Cases, per layer (16 layers, each with its own weights, past the 60 MB L2), CUPTI and the wall
time in a graphed loop:
  - `kernel`: the kernel, each layer's h2 the next one's x (the attention held fixed);
  - `kernel_bare`: the same without the merge, norms and SwiGLU (wrong numbers; what they
    cost), and `kernel_free` without the barriers too (the schedule's weight stream alone);
  - `kernel_nowait`, `kernel_nostore`: `kernel_bare` arriving at a barrier without waiting
    for the program's stores to complete, and storing nothing (what the stores cost);
    `kernel_unordered` arriving by a relaxed add, its stores not ordered before it;
  - `kernel_tma`, `kernel_bare_tma`: the partial sums stored through shared memory and TMA,
    each weight slot freed after the store (before session 49), and `kernel_early_tma` the
    TMA stores with the slot freed first;
  - `phases`: the layer as one kernel a phase, each taking its prologue first
    (`post_attention_phases`, `direct` weights only), `phases_bare` without the prologues
    (wrong numbers; what they cost there), and `phases_prefetch` with each kernel asking the
    L2 for the next one's first weight tiles as it ends (`layer`'s `prefetch_next`);
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

from benchmarks.common import environment, error_text, kernel_time_ms, step_time_ms
from jaxpaged.layers import rms_norm
from pallas_kernels.common import merge_splits
from pallas_kernels.mosaic.layer import (
    ROWS,
    TILE_K,
    TILE_N,
    Phase,
    Schedule,
    Shape,
    layer,
    phases,
    post_attention_phases,
    run_phases,
)
from probes.layer_stream import GRAPH_OPTIONS, barrier_trace, lateness, program_spans

LAYERS = 16
EPS = 1e-6
# `layer`'s diagnostic and store options per case (the others take its defaults)
OLD_STORES = dict(partials="tma", early_free=False)  # before session 49
CASE_OPTIONS = dict(
    kernel_nowait=dict(stores="nowait", **OLD_STORES),
    kernel_unordered=dict(stores="unordered"),
    kernel_nostore=dict(stores="none"),
    kernel_tma=OLD_STORES,
    kernel_bare_tma=OLD_STORES,
    kernel_early_tma=dict(partials="tma"),
)
WITH_PROLOGUES = ("kernel", "kernel_tma", "kernel_early_tma")  # the persistent kernel's cases
PHASE_CASES = ("phases", "phases_bare", "phases_prefetch")  # one kernel a phase: `direct` only
ONE_B = Shape()  # the `1b` model's layer


def _unit_tiles(w, phase: Phase):
    """w [K, N] -> [units, steps / (2 if pair), 128, 64]: unit (c, part) = c * parts + part
    reads rows part * steps' + s of column tile c."""
    k, n = w.shape
    tiles = w.reshape(k // TILE_K, TILE_K, n // TILE_N, TILE_N).transpose(2, 0, 1, 3)
    per = k // TILE_K // phase.parts
    return tiles.reshape(n // TILE_N * phase.parts, per, TILE_K, TILE_N)


def arrange(wo, w_gate, w_up, wd, wqkv, shape: Shape = ONE_B):
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


def simulate(
    attn, x, w, scale_mlp, scale_next, *, num_programs, real_rows, shape=ONE_B, split=False
):
    """The kernel's work, as `Schedule` deals it, in NumPy (float32 products of the bfloat16
    tiles; the norms and SwiGLU as the per-thread code computes them): what the CPU can check
    of the kernel's index arithmetic, its weight order (`arrange`, or the model's matrices
    with `w` a tuple, as `layer` takes them) and its stores. Raises if an output element is
    written twice or not at all, or if a program's o or down units need parts of K other than
    the one its prologue takes (merges, or takes SwiGLU of). Returns (h2, qkv partial sums),
    or for the last layer (h2, the final norm), as `layer` does, for the first `real_rows`
    rows; with `w` (wqkv,) alone (`norm_qkv`: attn and scale_mlp unused) the qkv partial sums
    of x's norm. With `split`, each phase as a kernel of its own (`layer(..., only=j)`, as
    `post_attention_phases` runs them), with that kernel's schedule."""
    direct = isinstance(w, tuple)
    last = direct and len(w) == 3
    qkv_only = direct and len(w) == 1
    assert not split or (direct and not qkv_only)
    sched = Schedule(shape, num_programs, direct, last, qkv_only)
    ps = sched.phases
    if direct:
        mats = [np.asarray(m, np.float32) for m in w]

        def tile_of(at, prog, i):
            k, c = at["w_k_step"][prog, i] * TILE_K, at["tile"][prog, i] * TILE_N
            return mats[at["phase"][prog, i] - sched.first][k : k + TILE_K, c : c + TILE_N]
    else:
        tiles = np.asarray(w, np.float32).reshape(-1, TILE_K, TILE_N)

        def tile_of(at, prog, i):
            return tiles[at["tile_row"][prog, i]]

    def planned(sched):
        """(what each program's iterations do, [first unit, units] per phase, which
        iterations run), as the layer's phases (o 0, ...) whatever the schedule starts with."""
        programs = jnp.arange(num_programs)
        info, local = sched.plan(programs)
        its = jnp.arange(sched.max_count)
        at = sched.locate(
            its[None, :], [(f[:, None], n[:, None]) for f, n in info], [v[:, None] for v in local]
        )
        at = {k: np.asarray(v) for k, v in at.items()}
        at["phase"] = at["phase"] + sched.first
        info = [None] * sched.first + [(np.asarray(f), np.asarray(n)) for f, n in info]
        return at, info, np.asarray(its[None, :] < local[-1][:, None])

    if split:
        plans = [planned(Schedule(shape, num_programs, True, only=j)) for j in range(len(ps))]
    else:
        plans = [planned(sched)] * len(ps)
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
    xs[0] = (
        norm(np.asarray(x, f32)[:rows], scale_next) if qkv_only else np.asarray(attn, f32)[:rows]
    )
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
        at, info, live = plans[j]
        for prog in range(num_programs):
            acc = np.zeros((rows, TILE_N), f32)
            for i in np.nonzero(live[prog] & (at["phase"][prog] == j + sched.first))[0]:
                k = at["k_step"][prog, i] * TILE_K
                if j == 2:  # the part of act the prologue took: its first unit's
                    width = shape.inter // p.parts
                    part = int(info[2][0][prog]) % p.parts
                    if at["part"][prog, i] != part:
                        raise AssertionError(f"program {prog}'s down units span parts of act")
                    xj = act[:, part * width : (part + 1) * width]
                else:
                    xj = xs[j]
                if j == 0 and not qkv_only:
                    # o's prologue merges the heads of its first unit's part only
                    if at["part"][prog, i] != int(info[0][0][prog]) % p.parts:
                        raise AssertionError(f"program {prog}'s o units span parts of K")
                acc += xj[:, k : k + TILE_K] @ tile_of(at, prog, i)
                if at["ends"][prog, i]:
                    part, tile, which = (at[n][prog, i] for n in ("part", "tile", "which"))
                    cols = slice(tile * TILE_N, (tile + 1) * TILE_N)
                    outs[j][part, :, which if p.pair else 0, cols] = acc
                    written[j][part, :, which if p.pair else 0, cols] += 1
                    acc = np.zeros_like(acc)
    for j, n in enumerate(written):
        if not (n == 1).all():
            raise AssertionError(f"phase {j}: outputs written {np.unique(n)} times")
    if qkv_only:
        return outs[0][:, :, 0]
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


def check_layer(attn, x, w, scales, kv_lens=None):
    """One layer of x's rows; also how many programs gave up on each barrier
    (`grid_barrier`)."""
    counters = jax.new_ref(jnp.zeros((3, 3), jnp.int32))
    h2, second = layer(attn, x, w, *scales, counters, parity=0, eps=EPS, kv_lens=kv_lens)
    return h2, second, counters[2]


def check_phases(attn, x, w, scales, kv_lens=None):
    """One layer of x's rows as `post_attention_phases` runs it (the model's own matrices)."""
    return post_attention_phases(attn, x, w, *scales, eps=EPS, kv_lens=kv_lens)


def kernel_layers(x, state, **kw):
    """The layers chained over x's rows, each one's h2 the next one's x; `kw` as `layer`'s."""
    attn, arranged, scales = state
    counters = jax.new_ref(jnp.zeros((3, 3), jnp.int32))
    for n, (w, (s_mlp, s_next)) in enumerate(zip(arranged, scales, strict=True)):
        x, _ = layer(attn, x, w, s_mlp, s_next, counters, parity=n % 2, eps=EPS, **kw)
    return x


def phase_layers(x, state, **kw):
    """The layers chained as `kernel_layers`, each as one kernel a phase (`run_phases`, as
    `pallas_kernels.mosaic.layer.post_attention_phases` runs them: the model's own
    matrices); `kw` as `run_phases`'s."""
    attn, weights, scales = state
    for w, (s_mlp, s_next) in zip(weights, scales, strict=True):
        x = run_phases(attn, x, w, s_mlp, s_next, eps=EPS, **kw)["h2"]
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


def traced(profile_dir, real, x, state, case="kernel"):
    """One profiled call of the 16 chained layers (`case` "kernel" or "kernel_bare"): per
    named region, the medians over the layers of `barrier_trace`'s figures, and each
    barrier's `lateness`."""
    directory = os.path.join(profile_dir, f"rows{real}_{case}")
    os.makedirs(directory, exist_ok=True)
    summary = dict(case="trace", traced=case, rows=real)
    try:
        kw = dict(profile_dir=directory, prologues=case == "kernel")
        fn = jax.jit(functools.partial(kernel_layers, **kw))
        jax.block_until_ready(fn(x[:real], state))
        paths = sorted(glob.glob(os.path.join(directory, "*.json")))[-LAYERS:]
        reports = [barrier_trace(path) for path in paths]
        for name in reports[0]:
            for key in reports[0][name]:
                values = sorted(r[name][key] for r in reports if r[name][key] is not None)
                if values:
                    summary[f"{name}.{key}"] = values[len(values) // 2]
        spans = [program_spans(path) for path in paths]
        summary["lateness"] = lateness(spans, ["barrier0", "barrier1", "barrier2", "kernel"])
        summary["end_lateness"] = lateness(spans, ["kernel"], at=2)
        ends = [[s[2] for s in report["kernel"] if s[2] is not None] for report in spans]
        summary["kernel_end_p50_p90_max_us"] = [
            round(float(np.median([np.percentile(e, q) for e in ends])), 3) for q in (50, 90, 100)
        ]
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
    parser.add_argument(
        "--live",
        type=int,
        default=None,
        help="rows past this many are inactive slots (kv_len 0), which the kernel skips",
    )
    parser.add_argument("--profile-dir", help="also trace one call of the kernel per case")
    parser.add_argument(
        "--trace-cases",
        nargs="+",
        default=["kernel"],
        choices=["kernel", "kernel_bare"],
        help="what `--profile-dir` traces",
    )
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
        live = real if args.live is None else min(args.live, real)
        lens = None if live == real else jnp.arange(real, dtype=jnp.int32) < live
        lens = None if lens is None else lens.astype(jnp.int32)
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
        check["live"] = live
        try:
            if args.simulate:
                h2, qkv = simulate(
                    attn, x, arranged[0], *scales[0], num_programs=132, real_rows=real
                )
            else:
                fn = jax.jit(check_layer)
                h2, qkv, failed = fn(attn_in, x[:real], arranged[0], scales[0], lens)
                check["barrier_give_ups"] = np.asarray(failed).tolist()
                again = fn(attn_in, x[:real], arranged[0], scales[0], lens)
                check["repeat_equal"] = bool(  # the live rows: the others are undefined
                    (np.asarray(again[1])[:, :live] == np.asarray(qkv)[:, :live]).all()
                    and (np.asarray(again[0])[:live] == np.asarray(h2)[:live]).all()
                )
            # bfloat16 outputs: a few ulps of rounding apart (sums in another order).
            check["h2_rel_err"] = rel_err(h2[:live], want_h2[:live])
            check["qkv_rel_err"] = rel_err(np.asarray(qkv).sum(0)[:live], want_qkv[:live])
            if not args.simulate:  # 16 layers chained, both ways: their drift apart
                got = jax.jit(functools.partial(kernel_layers, kv_lens=lens))(
                    x[:real], (attn_in, arranged, scales)
                )
                want = jax.jit(functools.partial(xla_layers, real_rows=real))(
                    x[:real], (attn_in, raw, scales)
                )
                check["chain_rel_err"] = rel_err(got[:live], want[:live])
            if not args.simulate and weights == "direct" and set(PHASE_CASES) & set(args.cases):
                # the phases' kernels: layer 0 twice, and 16 chained against XLA's
                fn = jax.jit(check_phases)
                h2, qkv = fn(attn_in, x[:real], arranged[0], scales[0], lens)
                again = fn(attn_in, x[:real], arranged[0], scales[0], lens)
                check["phases_repeat_equal"] = bool(
                    (np.asarray(again[1])[:, :live] == np.asarray(qkv)[:, :live]).all()
                    and (np.asarray(again[0])[:live] == np.asarray(h2)[:live]).all()
                )
                check["phases_h2_rel_err"] = rel_err(h2[:live], want_h2[:live])
                check["phases_qkv_rel_err"] = rel_err(
                    np.asarray(qkv).sum(0)[:live], want_qkv[:live]
                )
                got = jax.jit(functools.partial(phase_layers, kv_lens=lens))(
                    x[:real], (attn_in, arranged, scales)
                )
                check["phases_chain_rel_err"] = rel_err(got[:live], want[:live])
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
            case["live"] = live
            try:
                if name == "xla":
                    fn = jax.jit(functools.partial(xla_layers, real_rows=real))
                    args_ = (x[:real], (attn_in, raw, scales))
                elif name in PHASE_CASES:
                    if weights != "direct":
                        raise ValueError("the phases' kernels read the model's own matrices")
                    kw = dict(stages=stages, prologues=name != "phases_bare", kv_lens=lens)
                    kw["prefetch"] = name == "phases_prefetch"
                    fn = jax.jit(functools.partial(phase_layers, **kw))
                    args_ = (x[:real], (attn_in, arranged, scales))
                else:
                    kw = dict(
                        stages=stages,
                        prologues=name in WITH_PROLOGUES,
                        barriers=name != "kernel_free",
                        kv_lens=lens,
                        **CASE_OPTIONS.get(name, {}),
                    )
                    fn = jax.jit(functools.partial(kernel_layers, **kw))
                    args_ = (x[:real], (attn_in, arranged, scales))
                jax.block_until_ready(fn(*args_))
                case["us_per_layer"] = kernel_time_ms(fn, *args_) * 1e3 / LAYERS
                case["wall_us_per_layer"] = step_time_ms(looped(fn), *args_) * 1e3 / (10 * LAYERS)
            except Exception as e:  # noqa: BLE001 - a probe records and goes on
                case["error"] = error_text(e)
            print(json.dumps(case), flush=True)
            cases.append(case)
        if args.profile_dir:
            for case in args.trace_cases:
                trace = traced(args.profile_dir, real, x, (attn_in, arranged, scales), case)
                cases.append(dict(trace, weights=weights, splits=splits))
    if args.simulate:
        cases += check_schedules()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="layer_kernel", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
