"""PROBE: compile ours and mha (non-causal, Hq=Hkv=32, T=8192) so XLA dumps their PTX."""
import dataclasses
import sys

import jax
import jax.numpy as jnp

from benchmarks.triton_prefill_probe import D, DTYPE, SCALE, T, ours, paged_inputs
from pallas_kernels.triton.ragged_prefill import PrefillConfig

which = sys.argv[1]
if which == "mha":
    from jax.experimental.pallas.ops.gpu import attention as mha_mod

    q = jax.random.normal(jax.random.key(1), (1, T, 32, D), DTYPE)
    f = jax.jit(lambda q, k, v: mha_mod.mha(q, k, v, None, sm_scale=SCALE, causal=False, num_stages=3))
    jax.block_until_ready(f(q, q, q))
else:
    cfg = dataclasses.replace(PrefillConfig.default(D, DTYPE), page_mode="identity", num_stages=3)
    args = paged_inputs(32, T)
    jax.block_until_ready(jax.jit(ours(cfg, causal=False))(*args))
    cfg = PrefillConfig.default(D, DTYPE)
    jax.block_until_ready(jax.jit(ours(cfg, causal=True))(*paged_inputs(8, 64)))
print("ok", which)
