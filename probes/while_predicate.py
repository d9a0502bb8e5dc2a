"""Probe (runs 126, 168-169 and 173): a `lax.while_loop` whose condition only returns a predicate
carried from the body, under the engine's command-buffer options.

The decode block's trim of sessions 23 and 32 computed "another step runs" at the end of each
step and had the condition return it. On the H200 the block's step counter then disagreed with
the rows it wrote (15 or 17 steps for 16 tokens), from process to process. This probe runs the
same loop shape outside the model: each iteration writes row `step` of an output with
`dynamic_update_slice` and a small matmul keeps the GPU busy; the loop returns its counter.
Each case compares the counter and the rows written with the iterations that should run, for
the carried predicate and for the condition computed in `cond`, with and without command
buffers. One JSON line per case.

    python -m probes.while_predicate
"""

import json

import jax
import jax.numpy as jnp

from models.engine import LARGE_STEP_XLA_OPTIONS, SMALL_STEP_XLA_OPTIONS, compiler_options

ROWS, WIDTH, MAX_STEPS = 4, 1024, 16


def block(carried: bool):
    def fn(x, limit, budgets):
        def running(step, budgets):
            return (step < limit) & jnp.any(budgets > 0)

        def cond(carry):
            if carried:
                return carry[1]
            step, _, _, budgets, _ = carry
            return running(step, budgets)

        def body(carry):
            step, _, x, budgets, out = carry
            x = jnp.tanh(x @ x.T @ x * 1e-3)
            active = budgets > 0
            out = jax.lax.dynamic_update_slice(out, jnp.where(active, step, -1)[None], (step, 0))
            budgets = jnp.where(active, budgets - 1, budgets)
            step = step + 1
            return step, running(step, budgets), x, budgets, out

        out = jnp.full((MAX_STEPS, ROWS), -1, jnp.int32)
        init = (jnp.int32(0), running(jnp.int32(0), budgets), x, budgets, out)
        step, _, x, _, out = jax.lax.while_loop(cond, body, init)
        return step, jnp.sum(jnp.any(out >= 0, axis=1)), x

    return fn


def main():
    x = jax.random.normal(jax.random.key(0), (ROWS, WIDTH), jnp.float32)
    for name, options in (
        ("command buffers", SMALL_STEP_XLA_OPTIONS),
        ("none", LARGE_STEP_XLA_OPTIONS),
    ):
        for carried in (True, False):
            fn = jax.jit(block(carried), compiler_options=compiler_options(options))
            wrong, cases = [], 0
            for trial in range(3):
                for limit in range(MAX_STEPS + 1):
                    budgets = jnp.full((ROWS,), 12 + trial, jnp.int32)
                    step, rows, _ = jax.device_get(fn(x, jnp.int32(limit), budgets))
                    want = min(limit, 12 + trial)
                    cases += 1
                    if step != want or rows != want:
                        wrong.append(
                            dict(limit=limit, budget=12 + trial, step=int(step), rows=int(rows))
                        )
            print(
                json.dumps(
                    dict(
                        options=name,
                        carried_predicate=carried,
                        cases=cases,
                        wrong=wrong[:8],
                        num_wrong=len(wrong),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
