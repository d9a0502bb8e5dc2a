"""Microbench (run 231): the latency from a jitted call's launch to the host holding its small
outputs, beyond its GPU time: four outputs read by device_get, the same packed into one i32
array, and the four placed in pinned host memory by the executable."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

dev = jax.devices()[0]
w = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16)
x0 = jax.random.normal(jax.random.key(1), (256, 4096), jnp.bfloat16)


def body(w, x):
    for _ in range(24):
        x = jnp.tanh(x @ w)
    s = x.astype(jnp.float32)
    return (
        jnp.argmax(s, -1)[:16].astype(jnp.int32),
        s.max(-1)[:16],
        jnp.all(s[0] < 10),
        jnp.any(s[1] > 0),
    )


four = jax.jit(body)


def packed_body(w, x):
    t, l, ok, sh = body(w, x)
    return jnp.concatenate(
        [
            t,
            jax.lax.bitcast_convert_type(l, jnp.int32),
            ok.astype(jnp.int32)[None],
            sh.astype(jnp.int32)[None],
        ]
    )


packed = jax.jit(packed_body)
res = {}


def lat(name, f, read):
    out = f(w, x0)
    read(out)
    ts = []
    for _ in range(40):
        t = time.perf_counter()
        out = f(w, x0)
        read(out)
        ts.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(40):
        out = f(w, x0)
    read(out)
    gpu = (time.perf_counter() - t) / 40
    res[name] = dict(
        latency_ms=1e3 * float(np.median(ts)),
        pipelined_ms=1e3 * gpu,
        over_ms=1e3 * (float(np.median(ts)) - gpu),
    )
    print(name, res[name], flush=True)


lat("four_device_get", four, lambda o: jax.device_get(o))
lat("packed_one", packed, lambda o: np.asarray(o))
try:
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    pinned = jax.jit(body, out_shardings=host)
    lat("four_pinned_host", pinned, lambda o: jax.device_get(o))
    pinned1 = jax.jit(packed_body, out_shardings=host)
    lat("packed_pinned_host", pinned1, lambda o: np.asarray(o))
except Exception as e:
    res["pinned_error"] = repr(e)[:500]
    print(res["pinned_error"])
print(json.dumps(res))
