"""Probe: a decoder layer's MLP (gate/up, SwiGLU, down) as one Mosaic GPU kernel with no grid
barrier, against XLA's GEMMs (benchmarks/NOTES.md, "Session 26").

Run 134 (`probes/layer_stream.py`) measured that a grid barrier with copies in flight costs about
as much as a kernel boundary, so a persistent layer kernel must avoid them. The MLP needs none:
give each program one 64-wide slice j of the intermediate dimension. It computes gate_j and up_j
over all of K (the whole x), SwiGLU in registers, and then its slice's share of the down
projection, act_j @ down[j, :], a partial of every output column. Nothing waits on another
program; the partials are summed afterwards (here by XLA, in the step by the norm that follows).

The weights are stored in the order the kernel reads them (a checkpoint would be permuted once
at load): per program, its 32 gate tiles, 32 up tiles and 32 down tiles of 64 x 64, one
contiguous 768 KB run, streamed by one `emit_pipeline` of TMA copies, a `wgmma` each (the
weights as M, x or the activation as N).

Cases, per layer (16 layers with their own weights, 1.2 GB, past the 60 MB L2), CUPTI:
  - `fused`: the kernel, then XLA's sum of the partials (the next layer's input);
  - `fused_nosum`: the kernel alone, every layer reading the same x;
  - `gateup_only`: the kernel's gate/up phase alone (its TB/s over the gate/up bytes);
  - `nostore`: the kernel without the down partials' shared-memory stores;
  - `xla`: gate/up, SwiGLU and down as the step computes them.

    python -m probes.mlp_stream --rows 2 16 --out results.json
"""

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.common import environment, error_text, kernel_time_ms
from pallas_kernels.mosaic.pipeline import TILED

HIDDEN, INTER = 2048, 6144
TILE = 64
K_TILES = HIDDEN // TILE  # gate and up tiles per program; also the down tiles (output columns)
LAYERS = 16


def arrange(w_gate, w_up, w_down):
    """[HIDDEN, INTER] x2 and [INTER, HIDDEN] -> [programs * 3 * HIDDEN, 64], program j's run:
    gate and up columns 64 j: (all HIDDEN rows each), then the 32 tiles w_down[64 j:, 64 m:]
    stacked in m order. A kernel reads it in blocks of [block_k, 64] rows."""
    p = INTER // TILE

    def tiles(w, rows, cols):  # [R, C] -> [C/64, R, 64]: column tile c, all of its rows
        return w.reshape(rows, cols // TILE, TILE).transpose(1, 0, 2)

    gate = tiles(w_gate, HIDDEN, INTER)  # [p, HIDDEN, 64]
    up = tiles(w_up, HIDDEN, INTER)
    down = w_down.reshape(p, TILE, HIDDEN // TILE, TILE).transpose(0, 2, 1, 3)  # [p, m, 64, 64]
    down = down.reshape(p, HIDDEN, TILE)
    return jnp.concatenate([gate, up, down], axis=1).reshape(p * 3 * HIDDEN, TILE)


def mlp_partials(x, w, *, block_k=128, stages=4, down=True, store=True):
    """x [R, HIDDEN] bf16 (R a multiple of 8), w from `arrange`. Returns the down projection's
    partials [programs, K_TILES, 64, R] float32: [p, m, c, r] is program p's share of
    out[r, 64 m + c]. Without `down` only the gate/up phase runs (what its stream costs);
    without `store` the down phase keeps its tiles in registers (what the stores cost)."""
    rows = x.shape[0]
    programs = INTER // TILE
    k_steps = HIDDEN // block_k
    per = block_k // TILE  # output tiles of a down block
    steps = 3 * k_steps  # the weights' row blocks of a program

    def body(x_ref, w_ref, out_ref, act_smem, out_smem):
        program = lax.axis_index("program")
        col = plgpu.broadcasted_iota(jnp.int32, (TILE, rows), 0, layout=plgpu.Layout.WGMMA)

        def mask(pred):  # a scalar predicate as a WGMMA-layout mask (a vector compare lowers)
            return col < jnp.where(pred, TILE, 0)

        def step(indices, x_smem, w_smem, carry):
            (i,) = indices
            gate, up = carry
            is_gate, is_up = i < k_steps, (i >= k_steps) & (i < 2 * k_steps)

            def mma_x(acc_ref):
                plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)

            r = pl.run_state(mma_x)(plgpu.ACC.init(jnp.where(mask(is_up), up, gate)))
            gate = jnp.where(mask(is_gate), r, gate)
            up = jnp.where(mask(is_up), r, up)

            @pl.when(i == 2 * k_steps - 1)
            def _():
                act = gate / (1.0 + jnp.exp(-gate)) * up
                act_smem.T[...] = act.astype(act_smem.dtype)
                plgpu.commit_smem()

            @pl.when(i >= 2 * k_steps)
            def _():
                q = i - 2 * k_steps
                zero = plgpu.layout_cast(jnp.zeros((TILE, rows), jnp.float32), plgpu.Layout.WGMMA)

                def mma_act(acc_refs):  # the block's output tiles: issued together, one wait
                    for t, acc_ref in enumerate(acc_refs):
                        tile = w_smem.at[pl.ds(t * TILE, TILE)]
                        plgpu.wgmma(acc_ref, tile.T, act_smem.T)

                outs = pl.run_state(mma_act)(tuple(plgpu.ACC.init(zero) for _ in range(per)))
                for t, out in enumerate(outs):
                    if store:
                        out_smem.at[q * per + t][...] = out
                    else:  # one tile only, at the end, so that the products stay live

                        @pl.when(q == k_steps - 1)
                        def _(t=t, out=out):
                            out_smem.at[t][...] = out

            return gate, up

        zero = plgpu.layout_cast(jnp.zeros((TILE, rows), jnp.float32), plgpu.Layout.WGMMA)
        plgpu.emit_pipeline(
            step,
            grid=(steps if down else 2 * k_steps,),
            in_specs=[
                plgpu.BlockSpec(
                    (rows, block_k), lambda i: (0, lax.rem(i, k_steps)), transforms=TILED
                ),
                plgpu.BlockSpec(
                    (block_k, TILE), lambda i: (program * steps + i, 0), transforms=TILED
                ),
            ],
            max_concurrent_steps=stages,
            init_carry=(zero, zero),
        )(x_ref, w_ref)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[program])
        plgpu.wait_smem_to_gmem(0)

    shape = (programs, K_TILES, TILE, rows)
    scratch = (
        plgpu.SMEM((rows, TILE), x.dtype, transforms=TILED),
        plgpu.SMEM((K_TILES, TILE, rows), jnp.float32),
    )
    out_type = jax.ShapeDtypeStruct(shape, jnp.float32)
    return plgpu.kernel(
        body, out_type=out_type, grid=(programs,), grid_names=("program",), scratch_types=scratch
    )(x, w)


def summed(partials, rows):
    """[p, m, c, R] -> [rows, HIDDEN] bf16."""
    return partials.sum(0).reshape(HIDDEN, -1).T[:rows].astype(jnp.bfloat16)


def fused_layers(x, ws, *, rows, **kw):
    for w in ws:
        h = summed(mlp_partials(x, w, **kw), rows)
        x = jnp.pad(h, ((0, x.shape[0] - rows), (0, 0)))
    return x


def fused_nosum_layers(x, ws, **kw):
    return [mlp_partials(x, w, **kw) for w in ws]


def xla_mlp(x, w_gate_up, w_down):
    gu = jnp.dot(x, w_gate_up, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(gu[:, :INTER]) * gu[:, INTER:]).astype(x.dtype)
    return jnp.dot(act, w_down)


def xla_layers(x, weights):
    for w_gate_up, w_down in weights:
        x = xla_mlp(x, w_gate_up, w_down)
    return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--block-k", type=int, nargs="+", default=[128])
    parser.add_argument(
        "--cases", nargs="+", default=["fused", "fused_nosum", "gateup_only", "xla"]
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    keys = map(functools.partial(jax.random.fold_in, jax.random.key(0)), itertools.count())
    dt = jnp.bfloat16
    scale = HIDDEN**-0.5
    raw = [
        (
            jax.random.normal(next(keys), (HIDDEN, 2 * INTER), dt) * scale,
            jax.random.normal(next(keys), (INTER, HIDDEN), dt) * INTER**-0.5,
        )
        for _ in range(LAYERS)
    ]
    arranged = [jax.jit(arrange)(gu[:, :INTER], gu[:, INTER:], d) for gu, d in raw]
    layer_bytes = 3 * HIDDEN * INTER * 2
    cases = []
    for rows in args.rows:
        padded = max(8, -(-rows // 8) * 8)
        x = jax.random.normal(next(keys), (padded, HIDDEN), dt)
        # Correctness of one layer against XLA in float32 (bf16 activation in both).
        try:
            want = xla_mlp(x[:rows], *raw[0]).astype(jnp.float32)
            for block_k in args.block_k:
                fn = jax.jit(functools.partial(mlp_partials, block_k=block_k))
                got = summed(fn(x, arranged[0]), rows).astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
                check = dict(check="layer 0", rows=rows, block_k=block_k, rel_err=err)
                print(json.dumps(check), flush=True)
                assert np.isfinite(err)
        except Exception as e:  # noqa: BLE001 - a probe records and goes on
            print(json.dumps(dict(check="layer 0", rows=rows, error=error_text(e))), flush=True)
        for name in args.cases:
            configs = (
                [dict()]
                if name == "xla"
                else [dict(stages=s, block_k=b) for s in args.stages for b in args.block_k]
            )
            for kw in configs:
                case = dict(case=name, rows=rows, **kw)
                try:
                    if name == "xla":
                        fn, args_ = jax.jit(xla_layers), (x[:rows], raw)
                    elif name == "fused":
                        fn = jax.jit(functools.partial(fused_layers, rows=rows, **kw))
                        args_ = (x, arranged)
                    else:
                        kw_ = dict(kw, down=name != "gateup_only", store=name != "nostore")
                        fn = jax.jit(functools.partial(fused_nosum_layers, **kw_))
                        args_ = (x, arranged)
                    jax.block_until_ready(fn(*args_))
                    us = kernel_time_ms(fn, *args_) * 1e3 / LAYERS
                    case["us_per_layer"] = us
                    frac = 2 / 3 if name == "gateup_only" else 1
                    case["tb_s"] = layer_bytes * frac / us / 1e6
                except Exception as e:  # noqa: BLE001 - a probe records and goes on
                    case["error"] = error_text(e)
                print(json.dumps(case), flush=True)
                cases.append(case)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment(), probe="mlp_stream", cases=cases), f, indent=1)


if __name__ == "__main__":
    main()
