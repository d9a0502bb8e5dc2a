"""`jaxpaged.linear`: a decode step's projection, the XLA reference and the Mosaic GPU kernel
(pallas_kernels/mosaic/projection.py, compiled on the H200 only: `wgmma` has no interpreter),
against a float64 numpy oracle, and the checks that run before anything is traced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers import fuse_gate_up, gate_up_block, linear, split_gate_up
from pallas_kernels.common import poison_outputs
from pallas_kernels.mosaic import projection as mosaic_projection

# Both paths accumulate in float32 (K <= 6144 terms: ~1e-6 relative) and round the result to
# the dtype once (half an ulp: 2^-9 relative in bfloat16, 2^-12 in float16): RTOL is four of
# those. SwiGLU's XLA path rounds four times (gate, up, silu(gate), the product) and silu
# doubles a relative error of a negative gate: `SWIGLU` times more. Outputs are O(1) here.
RTOL = {jnp.bfloat16: 2**-7, jnp.float16: 2**-10}
ATOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
SWIGLU = 4
IMPLEMENTATIONS = [
    pytest.param("xla", id="xla"),
    pytest.param("mosaic", id="mosaic-gpu", marks=pytest.mark.gpu),
]


def _oracle(x, w, activation):
    y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if activation == "swiglu":
        gate, up = (np.asarray(a, np.float64) for a in split_gate_up(jnp.asarray(w)))
        g = np.asarray(x, np.float64) @ gate
        u = np.asarray(x, np.float64) @ up
        y = g / (1 + np.exp(-g)) * u
    return y


def _inputs(rows, k, n, dtype, seed):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", [None, "swiglu"])
@pytest.mark.parametrize(
    "rows, k, n",
    [
        (1, 128, 128),
        (2, 2048, 4096),
        (7, 256, 384),
        (16, 6144, 2048),
        (33, 640, 1280),
        (64, 2048, 1024),
    ],
)
def test_linear_matches_the_oracle(implementation, dtype, activation, rows, k, n):
    x, w = _inputs(rows, k, n, dtype, seed=rows * 7 + k)
    with poison_outputs():
        got = linear(x, w, activation=activation, implementation=implementation)
    want = _oracle(x, w, activation)
    assert got.shape == want.shape and got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert not np.isnan(got).any()
    factor = SWIGLU if activation == "swiglu" else 1
    np.testing.assert_allclose(got, want, rtol=factor * RTOL[dtype], atol=factor * ATOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["pipelined-x", "pdl"])
@pytest.mark.parametrize("num_programs", [1, 3, 7, 50, 132, 400])
@pytest.mark.parametrize("tile_k, num_stages", [(64, 2), (128, 4), (256, 3)])
def test_every_walk_of_the_mosaic_kernel_sums_each_tile_once(num_programs, tile_k, num_stages, pdl):
    """Shares of one iteration (more programs than iterations are cut to the iterations),
    shares spanning many tiles, tiles summed from many contributions: all equal the oracle."""
    x, w = _inputs(5, 1536, 1024, jnp.bfloat16, seed=num_programs)
    config = mosaic_projection.ProjectionConfig(
        tile_k=tile_k, num_stages=num_stages, num_programs=num_programs, pdl=pdl
    )
    for activation in (None, "swiglu"):
        with poison_outputs():
            got = mosaic_projection.projection(x, w, activation=activation, config=config)
        got = np.asarray(got.astype(jnp.float32), np.float64)
        assert not np.isnan(got).any()
        want = _oracle(x, w, activation)
        factor = SWIGLU if activation == "swiglu" else 1
        np.testing.assert_allclose(
            got, want, rtol=factor * RTOL[jnp.bfloat16], atol=factor * ATOL[jnp.bfloat16]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["pipelined-x", "pdl"])
def test_a_chain_of_calls_reads_each_input_after_it_is_written(pdl):
    """A chain of calls (one executable, the layers of a step), each reading the last one's
    output: the tiles' semaphores go back to zero between calls, and a programmatic dependent
    launch reads x only once the call before it is done."""
    x, _ = _inputs(3, 1024, 1024, jnp.bfloat16, seed=0)
    ws = [_inputs(1, 1024, 1024, jnp.bfloat16, seed=s)[1] for s in range(1, 9)]
    config = mosaic_projection.ProjectionConfig(num_programs=96, pdl=pdl)

    @jax.jit
    def chain(x, ws):
        for w in ws:
            x = mosaic_projection.projection(x, w, config=config)
        return x

    want = np.asarray(x, np.float64)
    for w in ws:
        want = (want @ np.asarray(w, np.float64)).astype(np.float32)
        want = np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float64)
    for _ in range(3):
        got = np.asarray(chain(x, ws).astype(jnp.float32), np.float64)
        np.testing.assert_allclose(got, want, rtol=2**-6, atol=2e-2)


def test_gate_up_blocks_round_trip_and_keep_pairs_together():
    gate = jax.random.normal(jax.random.key(1), (8, 1536))
    up = jax.random.normal(jax.random.key(2), (8, 1536))
    fused = fuse_gate_up(gate, up)
    assert gate_up_block(1536) == 64
    np.testing.assert_array_equal(fused[:, :64], gate[:, :64])
    np.testing.assert_array_equal(fused[:, 64:128], up[:, :64])
    back = split_gate_up(fused)
    np.testing.assert_array_equal(back[0], gate)
    np.testing.assert_array_equal(back[1], up)
    # Smaller sizes take the largest block that every split over up to 8 devices keeps whole.
    assert gate_up_block(192) == 8 and gate_up_block(40) == 1 and gate_up_block(3) == 1
    odd = fuse_gate_up(gate[:, :192], up[:, :192])
    np.testing.assert_array_equal(odd[:, 8:16], up[:, :8])
    np.testing.assert_array_equal(split_gate_up(odd)[1], up[:, :192])


@pytest.mark.parametrize(
    "x_shape, w_shape, activation, message",
    [
        ((2, 128), (128, 128), "relu", "activation must be one of"),
        ((2, 128), (64, 128), None, "w must be"),
        ((2, 3, 128), (128, 128), None, "x must be"),
        ((2, 128), (128, 97), "swiglu", "multiple of 2"),
    ],
)
def test_linear_rejects_bad_arguments(x_shape, w_shape, activation, message):
    x = jnp.ones(x_shape, jnp.bfloat16)
    w = jnp.ones(w_shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        linear(x, w, activation=activation)


def test_the_mosaic_kernel_names_what_it_does_not_take():
    x = jnp.ones((65, 128), jnp.bfloat16)
    w = jnp.ones((128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"T <= 64"):
        mosaic_projection.projection(x, w)
    with pytest.raises(TypeError, match="share a dtype"):
        mosaic_projection.projection(x[:2], w.astype(jnp.float16))
    with pytest.raises(ValueError, match="tile_k"):
        mosaic_projection.projection(x[:2], w, config=mosaic_projection.ProjectionConfig(tile_k=96))
    with pytest.raises(ValueError, match="unknown implementation"):
        linear(x, w, implementation="cuda")
