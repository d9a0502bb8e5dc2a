"""Microbench (run 226): a jitted call's host time with 11 numpy inputs or one packed array,
beside 230 device arguments, against the same inputs already on the device."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

params = [jnp.ones((64, 64), jnp.bfloat16) * i for i in range(230)]


@jax.jit
def f(params, inputs):
    return sum(x.sum() for x in inputs) + params[0][0, 0].astype(jnp.float32)


def run(inputs, reps=200):
    out = f(params, inputs)
    out.block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = f(params, inputs)
        ts.append(time.perf_counter() - t)
        out.block_until_ready()
    return 1e6 * np.median(ts)


sizes = [2048, 16, 17, 16, 16, 16, 16, 16, 16, 16, 16]
many = [np.arange(n, dtype=np.int32) for n in sizes]
one = [np.arange(sum(sizes), dtype=np.int32)]
dev_many = [jnp.asarray(x) for x in many]
res = dict(
    numpy_11=run(many),
    numpy_1=run(one),
    device_11=run(dev_many),
    device_1=run([jnp.asarray(one[0])]),
)
t = time.perf_counter()
for _ in range(200):
    jax.device_put(one[0])
res["device_put_1_us"] = 1e6 * (time.perf_counter() - t) / 200
print(json.dumps(res))
