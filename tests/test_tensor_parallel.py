"""Tensor parallelism: the decoder and engine on meshes of 2 and 4 devices give the logits and
tokens of one device, with one all-reduce per row-parallel projection in the compiled steps.

The meshes are of host (CPU) devices on every machine, so the same tests run in CI and on the GPU
image. A process has as many host devices as `XLA_FLAGS` asked for before jax started; the test
session has one (four made a later XLA CPU compilation of the long session crash), so
`test_on_four_host_devices` runs this file again in a subprocess that has four.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.checkpoint import load_pretrained
from models.config import CONFIGS, EngineConfig
from models.decoder import Decoder
from models.engine import Engine
from models.parallel import make_mesh
from models.scheduler import SamplingParams
from tests.hf_checkpoints import hf_config, hf_tensors, write_checkpoint

# Hkv = 4 so that every mesh size up to 4 divides it.
CONFIG = dataclasses.replace(CONFIGS["tiny"], num_q_heads=8, num_kv_heads=4)
ENGINE = EngineConfig(num_pages=32, max_seqs=4, max_tokens_per_step=64, max_model_len=128)
# Float32 logits (magnitude ~5): a split changes only the order in which the all-reduce adds the
# devices' partial sums of o_proj and down_proj (~1e-7 relative each); through two layers and
# the vocabulary projection, measured 5e-6 on 2 and 4 devices: 1e-5.
F32_LOGIT_TOL = 1e-5
COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


HOST_DEVICES = 4
needs_host_devices = pytest.mark.skipif(
    jax.device_count("cpu") < HOST_DEVICES,
    reason=f"needs {HOST_DEVICES} host devices: run by test_on_four_host_devices",
)


@pytest.mark.skipif(jax.device_count("cpu") >= HOST_DEVICES, reason="this process has them")
def test_on_four_host_devices():
    """This file's tests, in a process with four host devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=4")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    # Everything but this test itself, which skips there.
    assert re.fullmatch(r"\d+ passed, 1 skipped(, \d+ warnings?)? in .*", summary), summary


def _cpu_mesh(tp: int):
    return make_mesh(tp, jax.devices("cpu"))


def _engine(tp: int | None, config=CONFIG, **changes) -> Engine:
    mesh = None if tp is None else _cpu_mesh(tp)
    return Engine(
        Decoder(config, rngs=nnx.Rngs(0)),
        dataclasses.replace(ENGINE, **changes),
        implementation="xla",
        mesh=mesh,
    )


PROMPTS = [np.random.default_rng(i).integers(0, 512, n).tolist() for i, n in enumerate((37, 5, 20))]


@needs_host_devices
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("chunk", [None, 16], ids=["single-shot", "chunked"])
def test_same_logits_and_tokens_on_every_mesh(tp, chunk):
    """Prompt logits within float32 reordering of one device's, the same greedy tokens, and
    the same outputs from decode blocks. Meshes of 2 and 4: one device would run the same
    sharded program with nothing split, at ~20 s of compiles in CI."""
    changes = {} if chunk is None else dict(chunk_size=chunk)
    params = SamplingParams(12)
    ref = _engine(None, **changes).generate(PROMPTS, params, record_prompt_logits=True)
    split = _engine(tp, **changes)
    seqs = split.generate(PROMPTS, params, record_prompt_logits=True)
    for seq, want in zip(seqs, ref, strict=True):
        assert np.all(np.isfinite(seq.prompt_logits))
        np.testing.assert_allclose(seq.prompt_logits, want.prompt_logits, atol=F32_LOGIT_TOL)
        assert seq.output == want.output
    blocks = split.generate(PROMPTS, params)  # decode blocks (no recorded logits)
    assert split.stats.blocks > 0
    assert [s.output for s in blocks] == [s.output for s in ref]


def _collectives(text: str) -> collections.Counter:
    return collections.Counter(COLLECTIVE.findall(text))


@needs_host_devices
@pytest.mark.parametrize("tp", [2, 4])
def test_steps_have_one_all_reduce_per_row_parallel_projection(tp):
    """Mixed steps and decode blocks: exactly o_proj's and down_proj's all-reduce per layer,
    and no other collective (attention and the K/V append run per device)."""
    engine = _engine(tp)
    [seq] = [engine.add_request(PROMPTS[0], SamplingParams(4))]
    plan = engine.scheduler.schedule()
    expected = collections.Counter({"all-reduce": 2 * CONFIG.num_layers})
    with engine._calling():
        step = engine.step_fn(False).lower(
            engine.param_leaves,
            engine.kv_pages,
            engine.pool,
            engine._inputs(plan, decode=False),
            decode=False,
            all_logits=False,
            implementation="xla",
        )
        block = engine.block_fn.lower(
            engine.param_leaves,
            engine.kv_pages,
            engine.pool,
            engine._block_inputs([seq]),
            num_steps=ENGINE.decode_steps,
            implementation="xla",
        )
        assert _collectives(step.compile().as_text()) == expected
        assert _collectives(block.compile().as_text()) == expected  # the loop body's


@needs_host_devices
def test_parameters_and_pages_are_split_over_the_mesh():
    engine = _engine(2)
    params = nnx.to_flat_state(engine.params)
    specs = {tuple(path[-3:]): v[...].sharding.spec for path, v in params if path[1] == 0}
    assert specs["attn", "qkv_proj", "kernel"] == P(None, "tp")
    assert specs["attn", "o_proj", "kernel"] == P("tp", None)
    assert specs["mlp", "gate_up_proj", "kernel"] == P(None, "tp")
    assert specs["mlp", "down_proj", "kernel"] == P("tp", None)
    assert specs[0, "input_norm", "scale"] == P()
    k_pages, _ = engine.kv_pages[0]
    assert k_pages.sharding.spec == P(None, None, "tp", None)
    assert k_pages.addressable_shards[0].data.shape[2] == CONFIG.num_kv_heads // 2
    assert engine.pool.kv_lens.sharding.is_fully_replicated


@needs_host_devices
def test_pool_updates_compile_on_a_mesh_and_keep_the_placement():
    """`Engine._compile_pool_updates` (the constructor's where steps run in command buffers)
    on a mesh changes no page and no slot, and the pages stay split by KV head, the pool
    replicated."""
    engine = _engine(2, prefix_caching=True)
    before = jax.device_get((engine.kv_pages, engine.pool))
    engine._compile_pool_updates()
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get((engine.kv_pages, engine.pool)), before
    )
    k_pages, _ = engine.kv_pages[0]
    assert k_pages.sharding.spec == P(None, None, "tp", None)
    assert engine.pool.kv_lens.sharding.is_fully_replicated


@needs_host_devices
def test_heads_must_divide_the_mesh():
    config = dataclasses.replace(CONFIG, num_kv_heads=2, num_q_heads=4)
    with pytest.raises(ValueError, match=r"num_kv_heads 2 must be a multiple of the 'tp'"):
        _engine(4, config=config)


@needs_host_devices
def test_checkpoint_is_placed_on_the_mesh(tmp_path):
    """load_pretrained(mesh=...) places each parameter split as it reads it; the split model
    gives the logits of the unsplit one."""
    config = hf_config("qwen2", num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    path = write_checkpoint(tmp_path, config, hf_tensors(config, np.random.default_rng(0)))
    mesh = _cpu_mesh(2)
    split, _ = load_pretrained(path, mesh=mesh)
    kernel = split.layers[0].attn.qkv_proj.kernel[...]
    assert kernel.sharding.spec == P(None, "tp") and kernel.sharding.mesh == mesh
    whole, _ = load_pretrained(path)
    prompt = [t % config["vocab_size"] for t in PROMPTS[0][:20]]
    outs = []
    for model, m in ((whole, None), (split, mesh)):
        engine = Engine(model, ENGINE, implementation="xla", mesh=m)
        [seq] = engine.generate([prompt], SamplingParams(1), record_prompt_logits=True)
        outs.append(seq.prompt_logits)
    np.testing.assert_allclose(outs[1], outs[0], atol=F32_LOGIT_TOL)


@needs_host_devices
def test_n_samples_on_a_mesh():
    """The forks of n-sample requests (pages split by KV head) give one device's samples, with
    their decode attention reading the shared prompt pages once per group (each device its
    heads of the groups' queries); the decode blocks still have only the projections'
    all-reduces."""
    params = SamplingParams(8, 0.9, seed=4, n=3)
    ref = _engine(None).generate(PROMPTS, params)
    split = _engine(2, shared_prefix_min_tokens=1)
    seqs = split.generate(PROMPTS, params)
    assert split.stats.forked_samples == 2 * len(PROMPTS)
    assert split.stats.shared_prefix_steps > 0
    [seq] = [split.add_request(PROMPTS[0], SamplingParams(4))]
    with split._calling():
        block = split.block_fn.lower(
            split.param_leaves,
            split.kv_pages,
            split.pool,
            split._block_inputs([seq]),
            num_steps=ENGINE.decode_steps,
            implementation="xla",
        )
        expected = collections.Counter({"all-reduce": 2 * CONFIG.num_layers})
        assert _collectives(block.compile().as_text()) == expected
    for seq, want in zip(seqs, ref, strict=True):
        assert [s.output for s in seq.samples] == [s.output for s in want.samples]
