"""The decode step's layer kernel path (`Decoder(layer_kernel=True)`): each layer's work after
attention as one `post_attention` call (`pallas_kernels.mosaic.layer` on Hopper).

On the CPU the path runs with `implementation="xla"`: the same structure (the first layer's
norm and qkv, then per layer `attend_states` and `post_attention`, which hands the next layer
its qkv and the last the final norm), every piece in XLA, against the step's own path. The
kernel is cross-lowered here and its schedule run in NumPy (`probes.layer_kernel.simulate`);
its arithmetic runs under the `gpu` marker.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxpaged
from models.config import CONFIGS, EngineConfig
from models.decoder import Decoder, fuse_gate_up, layer_counters, post_attention_reference
from models.engine import Engine
from models.scheduler import SamplingParams
from pallas_kernels.common import poison_outputs
from pallas_kernels.mosaic import layer as mosaic
from probes.deviceless import greedy_decode_block
from tests.helpers import lower_for_hopper
from tests.induction import induction_decoder, induction_prompt

PAGE = 16
# The two paths differ only in how float32 sums are ordered: the layer path takes o, gate/up,
# down and qkv as one dot each where the step's own path sums split-K partial sums (8 parts
# for o and down, 4 for qkv and gate/up). Float32 reorderings move each result by ~1e-7 of
# its magnitude; over the tiny model's 2 layers that stays well below 1e-5 (measured: at most
# 9.5e-7). bfloat16: the rounding points are the same, but a reordered float32 sum can round
# to the neighbouring bfloat16 value (2^-8 = 3.9e-3 relative), and one such flip moves what
# follows by about as much; 1e-2 allows two (measured on this CPU: 0, pages 2.7e-8).
HIDDEN_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# On the GPU the kernel sums its float32 partial products in an order of its own (over parts
# of K, per program) where the step's kernels have theirs, so flips are likelier: three of them
# in a row, amplified by a norm, over the two layers.
GPU_HIDDEN_TOL = 3e-2


def _model(dtype, layer_kernel: bool, **changes) -> Decoder:
    config = dataclasses.replace(CONFIGS["tiny"].with_dtype(dtype), **changes)
    return _random_norms(Decoder(config, rngs=nnx.Rngs(0), layer_kernel=layer_kernel))


def _random_norms(model: Decoder) -> Decoder:
    """Every RMSNorm's scale random (1 + 0.2 N(0, 1)), so that a norm taken with another
    layer's or the final norm's scale shows."""
    norms = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.RMSNorm)]
    keys = jax.random.split(jax.random.key(1), len(norms))
    for key, norm in zip(keys, norms, strict=True):
        shape, dtype = norm.scale.shape, norm.scale.dtype
        norm.scale[...] = (1 + 0.2 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return model


def _decode_step(config, num_slots: int, live: int, seed: int = 0):
    """Random tokens, pages (random K/V, not NaN: every cached slot is read) and the metadata of
    a decode step of `num_slots` sequence slots, the first `live` of them live."""
    rng = np.random.default_rng(seed)
    pages_per_seq, num_pages = 4, 4 * num_slots + 3
    kv_lens = np.where(np.arange(num_slots) < live, rng.integers(1, 4 * PAGE, num_slots), 0)
    table = rng.permutation(num_pages)[: num_slots * pages_per_seq].reshape(num_slots, -1)
    meta = jaxpaged.StepMetadata.build(
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(table, jnp.int32),
        jnp.arange(num_slots + 1, dtype=jnp.int32).clip(max=live),
        live,
        num_tokens=num_slots,
        decode=True,
        pool_shape=(num_pages, PAGE),
    )
    shape = (num_pages, PAGE, config.num_kv_heads, config.head_dim)
    keys = iter(jax.random.split(jax.random.key(seed), 2 * config.num_layers + 1))
    pages = [
        tuple(jax.random.normal(next(keys), shape, jnp.float32).astype(config.dtype) for _ in "kv")
        for _ in range(config.num_layers)
    ]
    tokens = jax.random.randint(next(keys), (num_slots,), 0, config.vocab_size)
    return tokens, pages, meta


def _step(model, tokens, pages, meta, implementation="xla"):
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, tokens, pages, meta):
        return nnx.merge(graphdef, params)(tokens, pages, meta, implementation=implementation)

    return run(params, tokens, pages, meta)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("num_slots", "live"), [(2, 1), (5, 5), (8, 6)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_layer_path_matches_the_step(dtype, num_slots, live, qk_norm):
    """The final hidden states of the live rows and every layer's pages, against the step's
    own path on the same weights; padding rows stay finite."""
    plain = _model(dtype, False, qk_norm=qk_norm)
    fused = _model(dtype, True, qk_norm=qk_norm)
    tokens, pages, meta = _decode_step(plain.config, num_slots, live)
    assert fused.runs_layer_kernel(num_slots, pages, meta, "xla")
    assert not plain.runs_layer_kernel(num_slots, pages, meta, "xla")
    want, want_pages = _step(plain, tokens, pages, meta)
    got, got_pages = _step(fused, tokens, pages, meta)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    scale = np.abs(want[:live]).max()
    np.testing.assert_allclose(got[:live], want[:live], atol=HIDDEN_TOL[dtype] * scale, rtol=0)
    for got_kv, want_kv in zip(got_pages, want_pages, strict=True):
        for g, w in zip(got_kv, want_kv, strict=True):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            np.testing.assert_allclose(g, w, atol=HIDDEN_TOL[dtype] * np.abs(w).max(), rtol=0)


def test_layer_path_only_where_it_applies():
    """Prefill steps, steps of more than 8 rows, projection biases, a GPU-less machine
    without "xla", and "xla" unless `layer_kernel` is True keep the step's own path."""
    model = _model(jnp.float32, True)
    tokens, pages, meta = _decode_step(model.config, 2, 2)
    assert model.runs_layer_kernel(2, pages, meta, "xla")
    assert not model.runs_layer_kernel(2, pages, dataclasses.replace(meta, decode=False), "xla")
    assert not model.runs_layer_kernel(9, pages, meta, "xla")
    assert not _model(jnp.float32, True, qkv_bias=True).runs_layer_kernel(2, pages, meta, "xla")
    if jax.default_backend() != "gpu":
        assert not model.runs_layer_kernel(2, pages, meta, None)
    # None: the kernels where they run, never the XLA structure (the step's own path on CPU).
    model.layer_kernel = None
    assert not model.runs_layer_kernel(2, pages, meta, "xla")
    qkv = jax.random.normal(jax.random.key(2), (2, 2, 4, 64), jnp.float32)  # never read
    prefill = dataclasses.replace(meta, decode=False)
    with pytest.raises(ValueError, match="attend_states takes a decode step's metadata"):
        model.layers[0].attn.attend_states(qkv, *pages[0], prefill, implementation="xla")


def test_layer_path_by_default_at_one_row_on_hopper(monkeypatch):
    """As if on an H200: `layer_kernel` None (the default) takes one-row decode steps through
    the kernels and leaves two rows and more to XLA's layers (where the kernels lost: B=4
    0.93x, B=8 0.82x, session 53); True takes up to 8 rows."""
    from jaxpaged import dispatch  # noqa: PLC0415

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "default_device", lambda: dispatch.Device("gpu", "9.0", 132))
    config = dataclasses.replace(CONFIGS["1b"], num_layers=1, vocab_size=512)
    model = Decoder(config, rngs=nnx.Rngs(0))
    page = jax.ShapeDtypeStruct((9, PAGE, 8, 128), jnp.bfloat16)
    runs = {}
    for rows in (1, 2, 8):
        meta = jaxpaged.StepMetadata.build(
            jnp.full((rows,), 5, jnp.int32),
            jnp.zeros((rows, 1), jnp.int32),
            jnp.arange(rows + 1, dtype=jnp.int32),
            rows,
            num_tokens=rows,
            decode=True,
            pool_shape=(9, PAGE),
        )
        for layer_kernel in (None, True):
            model.layer_kernel = layer_kernel
            runs[rows, layer_kernel] = model.runs_layer_kernel(rows, [(page, page)], meta, None)
    assert runs == {
        (1, None): True, (2, None): False, (8, None): False,
        (1, True): True, (2, True): True, (8, True): True,
    }  # fmt: skip


@pytest.mark.parametrize("max_seqs", [2, 1])
def test_engine_with_the_layer_path_gives_the_steps_tokens(max_seqs):
    """Greedy and sampled tokens through the engine's decode blocks, the layer path against
    the step's own, float32 (the chosen tokens' log-probabilities within 1e-4); at B=1 the
    layer path's blocks run one sequence slot (`LAYER_PATH_MIN_DECODE_ROWS`), the step's own
    two."""
    config = EngineConfig(page_size=PAGE, num_pages=32, max_seqs=max_seqs, max_model_len=128)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 23, 40)]
    params = [SamplingParams(12), SamplingParams(9, 0.8, seed=7), SamplingParams(15)]
    runs = []
    for layer_kernel in (False, True):
        engine = Engine(_model(jnp.float32, layer_kernel), config, implementation="xla")
        assert engine.decode_rows == (1 if layer_kernel and max_seqs == 1 else 2)
        runs.append(engine.generate(prompts, params))
    for want, got in zip(*runs, strict=True):
        assert got.output == want.output
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4, rtol=0)


def _layer_inputs(shape: mosaic.Shape, rows: int, splits: int, last: bool, seed: int = 0):
    """Random bfloat16 weights (the model's forms), scales, residual rows and the decode
    kernel's unmerged states (float32; bfloat16 for one split) for `post_attention`."""
    keys = iter(jax.random.split(jax.random.key(seed), 12))

    def normal(shape_, scale=1.0, dtype=jnp.bfloat16):
        return (jax.random.normal(next(keys), shape_, jnp.float32) * scale).astype(dtype)

    heads = shape.heads_dim // shape.head_dim
    gate, up = (normal((shape.hidden, shape.inter), shape.hidden**-0.5) for _ in "gu")
    weights = (
        normal((shape.heads_dim, shape.hidden), shape.heads_dim**-0.5),
        fuse_gate_up(gate, up),
        normal((shape.inter, shape.hidden), shape.inter**-0.5),
    )
    if not last:
        weights += (normal((shape.hidden, shape.qkv), shape.hidden**-0.5),)
    scales = (1 + normal((shape.hidden,), 0.1), 1 + normal((shape.hidden,), 0.1))
    out_dtype = jnp.float32 if splits > 1 else jnp.bfloat16
    states = (
        normal((rows, splits, heads, shape.head_dim), dtype=out_dtype),
        normal((rows, splits, heads), 3.0, jnp.float32),
    )
    return states, normal((rows, shape.hidden)), weights, scales


TINY = mosaic.model_shape(
    jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
    jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
    64,
)
ONE_B = mosaic.Shape()


@pytest.mark.parametrize(
    ("shape", "rows", "splits", "last"),
    [(ONE_B, 1, 10, False), (ONE_B, 2, 1, True), (TINY, 8, 3, False), (TINY, 5, 1, True)],
)
def test_post_attention_kernel_lowers_to_one_kernel(shape, rows, splits, last):
    """Cross-lowered for sm_90 here (its arithmetic runs on the GPU only): one Mosaic GPU
    custom call."""
    states, x, weights, scales = _layer_inputs(shape, rows, splits, last)

    def run(states, x, weights, scales):
        return mosaic.post_attention(
            states, x, weights, *scales, layer_counters(), parity=1, eps=1e-6
        )

    text = lower_for_hopper(run, states, x, weights, scales)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@mosaic_gpu" in calls[0], calls
    # The model's calls abort on a barrier that gives up (nothing reads their counts); the
    # probe's `layer` calls count and go on. (The module's bytecode holds the PTX strings.)
    assert "trap;" in calls[0]

    def probe(states, x, weights, scales):
        counters = layer_counters()
        return mosaic.layer(states, x, weights, *scales, counters, parity=1, eps=1e-6, shape=shape)

    text = lower_for_hopper(probe, states, x, tuple(weights), scales)
    assert "trap;" not in text and "red.relaxed.gpu.global.add.u32" in text


@pytest.mark.parametrize(
    ("shape", "rows", "splits", "last"),
    [(ONE_B, 1, 10, False), (ONE_B, 2, 1, True), (TINY, 8, 3, False), (TINY, 5, 1, True)],
)
def test_post_attention_phases_lower_to_four_kernels(shape, rows, splits, last):
    """Cross-lowered for sm_90: one Mosaic GPU kernel a phase (the last layer's fourth the
    final norm's `add_rms_norm`), with no grid barrier (no counter, no release add)."""
    states, x, weights, scales = _layer_inputs(shape, rows, splits, last)
    kv_lens = jnp.ones((rows,), jnp.int32)

    def run(states, x, weights, scales, kv_lens):
        return mosaic.post_attention_phases(states, x, weights, *scales, eps=1e-6, kv_lens=kv_lens)

    text = lower_for_hopper(run, states, x, weights, scales, kv_lens)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 4 and all("@mosaic_gpu" in line for line in calls), calls
    names = ["layer_o_kernel", "layer_gate_up_kernel", "layer_down_kernel"]
    names.append("add_rms_norm" if last else "layer_qkv_kernel")
    for name, call in zip(names, calls, strict=True):
        assert name in call
    assert "red.relaxed.gpu.global.add.u32" not in text and "ld.relaxed.gpu" not in text


def test_post_attention_phases_prefetch_the_next_kernels_weights():
    """With `prefetch`, the o, gate/up and down kernels issue TMA prefetches into the L2 (of
    the next kernel's weights), and the qkv kernel, the layer's last, none."""
    states, x, weights, scales = _layer_inputs(TINY, 2, 3, False)
    tma_prefetch = "cp.async.bulk.prefetch.tensor"
    for prefetch in (False, True):

        def run(states, x, weights, scales, prefetch=prefetch):
            return mosaic.post_attention_phases(
                states, x, weights, *scales, eps=1e-6, prefetch=prefetch
            )

        text = lower_for_hopper(run, states, x, weights, scales)
        calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
        assert [tma_prefetch in call for call in calls] == [prefetch] * 3 + [False]


def test_post_attention_phase_refuses_wrong_carried_outputs():
    states, x, weights, scales = _layer_inputs(TINY, 2, 1, False)
    o = jnp.zeros((1, 2, TINY.hidden), jnp.float32)
    with pytest.raises(ValueError, match=r"phase 3 takes carried \['d', 'h'\]; got \['o'\]"):
        mosaic.layer(
            None, x, (weights[3],), *scales, None, parity=0, eps=1e-6, only=3,
            carried={"o": o}, shape=TINY,
        )  # fmt: skip


LAYER_FORM_KERNELS = {"persistent": 2, "phases": 5}  # custom calls a layer, the decode kernel's


# The default form at one slot, two (one split's states) and eight; the persistent kernel at
# eight (CI time).
@pytest.mark.parametrize(
    ("form", "num_slots", "pages_per_seq"),
    [("phases", 1, 64), ("phases", 2, 2), ("phases", 8, 8), ("persistent", 8, 8)],
)  # fmt: skip
def test_layer_path_step_lowers_to_its_kernels(monkeypatch, form, num_slots, pages_per_seq):
    """The `1b`-shaped decode step through the layer path, cross-lowered for sm_90 as if on an
    H200 (the default device patched): the first layer's norm and qkv kernel, then per layer
    the decode kernel with `rope_append` folded in and the layer kernel (`persistent`), or
    its four phases' kernels (`phases`; the last layer's fourth the final norm), and no other
    custom call (no split merge; one split's bfloat16 states at 2 pages a sequence)."""
    from jaxpaged import dispatch  # noqa: PLC0415

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "default_device", lambda: dispatch.Device("gpu", "9.0", 132))
    layers = 3
    config = dataclasses.replace(CONFIGS["1b"], num_layers=layers, vocab_size=512)
    model = Decoder(config, rngs=nnx.Rngs(0), layer_kernel=True, layer_form=form)
    num_pages = num_slots * pages_per_seq + 1
    meta = jaxpaged.StepMetadata.build(
        jnp.full((num_slots,), 5, jnp.int32),
        jnp.zeros((num_slots, pages_per_seq), jnp.int32),
        jnp.arange(num_slots + 1, dtype=jnp.int32),
        num_slots,
        num_tokens=num_slots,
        decode=True,
        pool_shape=(num_pages, PAGE),
    )
    page = jax.ShapeDtypeStruct((num_pages, PAGE, 8, 128), jnp.bfloat16)
    pages = [(page, page)] * layers
    assert model.runs_layer_kernel(num_slots, pages, meta, None)
    graphdef, params = nnx.split(model)

    def step(params, tokens, pages, meta):
        return nnx.merge(graphdef, params)(tokens, pages, meta)

    tokens = jax.ShapeDtypeStruct((num_slots,), jnp.int32)
    text = lower_for_hopper(step, params, tokens, pages, meta)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert all("@mosaic_gpu" in line for line in calls), calls
    layer_calls = [line for line in calls if "layer_kernel" in line]
    assert len(layer_calls) == (layers if form == "persistent" else 0), calls
    assert sum("layer_down_kernel" in line for line in calls) == (form == "phases") * layers
    assert sum("norm_qkv_kernel" in line for line in calls) == 1, calls
    assert len(calls) == LAYER_FORM_KERNELS[form] * layers + 1, calls


@pytest.mark.parametrize("min_rows", [1, 2])
def test_decode_block_through_the_layer_path_lowers_for_hopper(monkeypatch, min_rows):
    """The engine's decode block (a while loop of steps) with the layer path in its default
    form, at B=1 in one sequence slot or two, cross-lowered for sm_90 as if on an H200: the
    first layer's norm and qkv kernel, per layer the decode kernel and the phases' kernels,
    and no other custom call."""
    from jaxpaged import dispatch  # noqa: PLC0415
    from models import engine as engine_module  # noqa: PLC0415

    layers = 3
    monkeypatch.setattr(engine_module, "LAYER_PATH_MIN_DECODE_ROWS", min_rows)
    config = dataclasses.replace(CONFIGS["1b"], num_layers=layers, vocab_size=512)
    model = Decoder(config, rngs=nnx.Rngs(0), layer_kernel=True)
    engine_config = EngineConfig(page_size=PAGE, num_pages=64, max_seqs=1, max_model_len=512)
    engine = Engine(model, engine_config, implementation="xla")  # built (compiled) on the CPU
    assert engine.decode_rows == min_rows
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(dispatch, "default_device", lambda: dispatch.Device("gpu", "9.0", 132))
    fn, args, static = greedy_decode_block(engine)
    text = fn.trace(*args, **static).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert all("@mosaic_gpu" in line for line in calls), calls
    assert sum("layer_down_kernel" in line for line in calls) == layers, calls
    assert sum("norm_qkv_kernel" in line for line in calls) == 1, calls
    assert len(calls) == LAYER_FORM_KERNELS["phases"] * layers + 1, calls


def _norm_qkv_inputs(hidden: int, qkv: int, rows: int, seed: int = 0):
    """Random bfloat16 rows, a fused qkv [hidden, qkv] and a norm scale for `norm_qkv`."""
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (rows, hidden), jnp.float32).astype(jnp.bfloat16)
    wqkv = jax.random.normal(keys[1], (hidden, qkv), jnp.float32) * hidden**-0.5
    scale = 1 + 0.2 * jax.random.normal(keys[2], (hidden,), jnp.float32)
    return x, wqkv.astype(jnp.bfloat16), scale.astype(jnp.bfloat16)


def _norm_qkv_reference(x, wqkv, scale, eps=1e-6):
    normed = jaxpaged.layers.rms_norm(x, scale, eps)
    return jnp.dot(normed, wqkv, preferred_element_type=jnp.float32)


@pytest.mark.parametrize(
    ("hidden", "qkv", "rows", "with_lens"), [(2048, 4096, 1, False), (128, 512, 8, True)]
)
def test_norm_qkv_kernel_lowers_to_one_kernel(hidden, qkv, rows, with_lens):
    x, wqkv, scale = _norm_qkv_inputs(hidden, qkv, rows)
    kv_lens = jnp.ones((rows,), jnp.int32) if with_lens else None

    def run(x, wqkv, scale, kv_lens):
        return mosaic.norm_qkv(x, wqkv, scale, eps=1e-6, kv_lens=kv_lens)

    text = lower_for_hopper(run, x, wqkv, scale, kv_lens)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "norm_qkv_kernel" in calls[0], calls


def test_norm_qkv_kernel_refuses_what_it_does_not_take():
    x, wqkv, scale = _norm_qkv_inputs(128, 512, 2)
    cases = [
        ((x.astype(jnp.float32), wqkv.astype(jnp.float32), scale), "bfloat16 only; got float32"),
        ((jnp.concatenate([x] * 5)[:9], wqkv, scale), "at most 8 rows; got 9"),
        ((x, wqkv[:64], scale), r"x \[R, 128\] needs wqkv \[128, qkv\]"),
        ((x, wqkv[:, :448], scale), "whole 128-column tiles"),
        (_norm_qkv_inputs(14336, 128, 1), "bytes of shared memory a program, over"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            mosaic.norm_qkv(*args, eps=1e-6)


@pytest.mark.parametrize("programs", [132, 8, 6])
def test_norm_qkv_schedule_writes_every_output_once(programs):
    """`norm_qkv`'s schedule (qkv alone, each program's norm first) at the tiny shape in
    NumPy: every output element written exactly once, the sum of its parts against XLA."""
    from probes.layer_kernel import simulate  # noqa: PLC0415

    x, wqkv, scale = _norm_qkv_inputs(128, 512, 3)
    shape = mosaic.Shape(hidden=128, qkv=512)
    parts = simulate(None, x, (wqkv,), None, scale, num_programs=programs, real_rows=3, shape=shape)
    want = np.asarray(_norm_qkv_reference(x, wqkv, scale))
    np.testing.assert_allclose(parts.sum(0), want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_post_attention_kernel_refuses_what_it_does_not_take():
    states, x, weights, scales = _layer_inputs(TINY, 2, 1, False)
    counters = jnp.zeros((3, 3), jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 only; got float32"):
        mosaic.post_attention(
            states, x.astype(jnp.float32), weights, *scales, counters, parity=0, eps=1e-6
        )
    nine = jnp.concatenate([x] * 5)[:9]
    with pytest.raises(ValueError, match="at most 8 rows; got 9"):
        mosaic.post_attention(states, nine, weights, *scales, counters, parity=0, eps=1e-6)
    odd = mosaic.Shape(hidden=192, heads_dim=256, inter=256, qkv=512, head_dim=64)
    assert "whole 128-column tiles" in mosaic.supported(odd, 1, jnp.bfloat16)
    wide = mosaic.Shape(hidden=12288, heads_dim=6144, inter=33792, qkv=8192)  # x: 192 KB
    assert "bytes of shared memory a program, over" in mosaic.supported(wide, 1, jnp.bfloat16)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("programs", [132, 8, 6])
@pytest.mark.parametrize("last", [False, True])
def test_post_attention_schedule_writes_every_output_once(programs, last, split):
    """The kernel's schedule at the tiny shape, run in NumPy (`probes.layer_kernel.simulate`:
    every output element written exactly once, a program's o and down units within one part
    of K), against the XLA reference; with `split` the phases' own kernels' schedules
    (`post_attention_phases`)."""
    from probes.layer_kernel import reference, simulate  # noqa: PLC0415

    states, x, weights, scales = _layer_inputs(TINY, 3, 1, last)
    attn = jnp.zeros((mosaic.ROWS, TINY.heads_dim), jnp.bfloat16)
    attn = attn.at[:3].set(states[0][:, 0].reshape(3, -1))
    h2, second = simulate(
        attn,
        x,
        tuple(weights),
        *scales,
        num_programs=programs,
        real_rows=3,
        shape=TINY,
        split=split,
    )
    gate, up = weights[1][:, 0::2], weights[1][:, 1::2]
    wqkv = None if last else weights[3]
    want_h2, want = reference(attn[:3], x, weights[0], gate, up, weights[2], wqkv, *scales)
    second = second if last else np.asarray(second).sum(0)
    for got, ref in ((h2, want_h2), (second, want)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_allclose(got, ref, atol=1e-2 * np.abs(ref).max(), rtol=0)


# bfloat16 kernel against the XLA reference: the same rounding points, float32 sums in another
# order (partial sums over parts of K); a flipped bfloat16 rounding in h or act moves the
# outputs by ~2^-8 of their magnitude: 1e-2 relative to the largest.
KERNEL_TOL = 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "rows", "splits", "last", "dead"),
    [
        (ONE_B, 1, 10, False, ()),
        (ONE_B, 2, 1, False, ()),
        (ONE_B, 2, 10, False, (1,)),  # B=1 in the engine: the second slot is padding
        (ONE_B, 2, 10, True, (1,)),
        (ONE_B, 8, 4, False, ()),
        (ONE_B, 8, 4, True, (0, 5)),
        (TINY, 3, 2, False, (0,)),
        (TINY, 1, 1, True, ()),
    ],
)
@pytest.mark.parametrize("form", sorted(LAYER_FORM_KERNELS))
def test_post_attention_kernel_matches_the_reference(shape, rows, splits, last, dead, form):
    """The kernel (`persistent`), or the phases' kernels (`phases`), against
    `models.decoder.post_attention`'s XLA arithmetic, outputs poisoned first; twice, the same
    bits; no barrier gave up. Rows of inactive slots (`dead`, kv_len 0) are skipped: the live
    rows as without them, the dead rows' final norm zero."""
    states, x, weights, scales = _layer_inputs(shape, rows, splits, last)
    kv_lens = jnp.asarray([0 if r in dead else 1 + r for r in range(rows)], jnp.int32)
    live = np.asarray(kv_lens) > 0

    @jax.jit
    def run(states, x, weights, scales, kv_lens):
        if form == "phases":
            out = mosaic.post_attention_phases(
                states, x, weights, *scales, eps=1e-6, kv_lens=kv_lens
            )
            return out, jnp.zeros((3,), jnp.int32)
        counters = layer_counters()
        out = mosaic.post_attention(
            states, x, weights, *scales, counters, parity=0, eps=1e-6, kv_lens=kv_lens
        )
        return out, counters[2]

    lens = kv_lens if dead else None
    with poison_outputs():
        (h2, second), give_ups = run(states, x, weights, scales, lens)
        (h2_again, second_again), _ = run(states, x, weights, scales, lens)
    assert (np.asarray(give_ups) == 0).all(), give_ups
    np.testing.assert_array_equal(np.asarray(h2)[live], np.asarray(h2_again)[live])
    row_axis = 0 if last else 1  # qkv: [parts, R, cols]
    np.testing.assert_array_equal(
        np.compress(live, np.asarray(second), row_axis),
        np.compress(live, np.asarray(second_again), row_axis),
    )
    if last:
        assert (np.asarray(second)[~live] == 0).all()

    want_h2, want = post_attention_reference(states, x, weights, *scales, eps=1e-6)
    want = want if last else want[0]
    got = np.asarray(second, np.float32) if last else np.asarray(second).sum(0)
    for g, w in ((np.asarray(h2, np.float32), want_h2), (got, want)):
        g, w = g[live], np.asarray(w, np.float32)[live]
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, atol=KERNEL_TOL * np.abs(w).max(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("hidden", "qkv", "rows", "dead"),
    [(2048, 4096, 1, ()), (2048, 4096, 2, (1,)), (2048, 4096, 8, (0, 5)), (128, 512, 3, ())],
)
def test_norm_qkv_kernel_matches_the_reference(hidden, qkv, rows, dead):
    """The first layer's norm and qkv kernel against XLA, outputs poisoned first; twice, the
    same bits. Rows of inactive slots (`dead`) are skipped, the live rows as without them.
    The norm rounds to bfloat16 at the same point as XLA's; its float32 sum of squares in
    another order can flip a rounding (2^-8 of an element): `KERNEL_TOL`."""
    x, wqkv, scale = _norm_qkv_inputs(hidden, qkv, rows)
    kv_lens = jnp.asarray([0 if r in dead else 1 + r for r in range(rows)], jnp.int32)
    live = np.asarray(kv_lens) > 0
    run = jax.jit(lambda *a: mosaic.norm_qkv(*a, eps=1e-6, kv_lens=kv_lens if dead else None))
    with poison_outputs():
        got, again = run(x, wqkv, scale), run(x, wqkv, scale)
    got, again = np.asarray(got)[:, live], np.asarray(again)[:, live]
    np.testing.assert_array_equal(got, again)
    assert np.isfinite(got).all()
    want = np.asarray(_norm_qkv_reference(x, wqkv, scale))[live]
    np.testing.assert_allclose(got.sum(0), want, atol=KERNEL_TOL * np.abs(want).max(), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("form", sorted(LAYER_FORM_KERNELS))
@pytest.mark.parametrize("num_slots", [2, 8])
def test_layer_kernel_decoder_matches_the_step_on_the_gpu(num_slots, form):
    """bfloat16 `1b`-shaped layers (2 of them) through the kernel path (in each form) against
    the step's own path on the GPU."""
    config = dataclasses.replace(CONFIGS["1b"], num_layers=2, vocab_size=512)
    plain = _random_norms(Decoder(config, rngs=nnx.Rngs(0)))
    fused = Decoder(config, rngs=nnx.Rngs(0), layer_kernel=True, layer_form=form)
    fused = _random_norms(fused)
    tokens, pages, meta = _decode_step(config, num_slots, num_slots - 1)
    assert fused.runs_layer_kernel(num_slots, pages, meta, None)
    want, want_pages = _step(plain, tokens, pages, meta, None)
    got, got_pages = _step(fused, tokens, pages, meta, None)
    live = num_slots - 1
    got, want = np.asarray(got, np.float32)[:live], np.asarray(want, np.float32)[:live]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=GPU_HIDDEN_TOL * np.abs(want).max(), rtol=0)
    for got_kv, want_kv in zip(got_pages, want_pages, strict=True):
        for g, w in zip(got_kv, want_kv, strict=True):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            tol = GPU_HIDDEN_TOL * np.abs(w).max()
            np.testing.assert_allclose(g, w, atol=tol, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("form", sorted(LAYER_FORM_KERNELS))
@pytest.mark.parametrize("max_seqs", [4, 1])
def test_engine_with_the_layer_kernel_gives_the_induction_tokens(max_seqs, form):
    """The induction decoder (confident bfloat16 predictions, `tests/induction.py`) through the
    engine's decode blocks: the kernel path's greedy tokens (in each form) equal the step's
    own path's; also at B=1, where the path runs one sequence slot (the layer kernel's R =
    1)."""
    config = EngineConfig(page_size=PAGE, num_pages=64, max_seqs=max_seqs, max_model_len=256)
    tiny = CONFIGS["tiny"].with_dtype(jnp.bfloat16)
    prompts = [induction_prompt(n, 12, s, tiny.vocab_size) for s, n in enumerate((40, 61, 90))]
    runs = []
    for layer_kernel in (False, True):
        model = induction_decoder(tiny)
        model.layer_kernel, model.layer_form = layer_kernel, form
        _, pages, meta = _decode_step(tiny, config.max_seqs, min(3, config.max_seqs))
        assert model.runs_layer_kernel(config.max_seqs, pages, meta, "mosaic") == layer_kernel
        engine = Engine(model, config, implementation="mosaic")
        assert engine.decode_rows == (1 if layer_kernel and max_seqs == 1 else max(2, max_seqs))
        runs.append(engine.generate(prompts, SamplingParams(24)))
        assert engine.stats.decode_tokens > 0
    for want, got in zip(*runs, strict=True):
        assert got.output == want.output
