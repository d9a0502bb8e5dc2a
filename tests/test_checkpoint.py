"""Hugging Face checkpoints: each architecture loads from files written in the Hugging Face layout
and gives the logits of its float64 forward (`tests/hf_checkpoints.py`); sharded, tied and
16-bit checkpoints load; every bad input fails with an error naming the file and the rule; the
text CLI streams a tokenized prompt's continuation and stops at the model's EOS.
"""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import split_qkv
from models import generate
from models.checkpoint import (
    CheckpointError,
    config_from_hf,
    eos_token_ids,
    load_pretrained,
    load_tokenizer,
)
from models.config import EngineConfig
from models.engine import Engine
from models.scheduler import SamplingParams
from tests.hf_checkpoints import (
    ARCHS,
    BFLOAT16,
    hf_config,
    hf_forward,
    hf_tensors,
    train_tokenizer,
    write_checkpoint,
)

PROMPT_LEN = 20  # more than Mistral's window of 8 and than Llama's original context band
# Float32 logits (|logit| up to ~8) against the float64 forward: the float32 roundings of each
# matmul over 128-384 terms and of the softmax, through two layers, measured at 3e-6 to 7e-6;
# 1e-4, the bound transformers parity is held to, leaves room for other summation orders.
F32_LOGIT_TOL = 1e-4


def _prompt_logits(model, prompt, chunk=None) -> np.ndarray:
    engine = Engine(
        model,
        EngineConfig(
            page_size=16,
            num_pages=4,
            max_seqs=1,
            max_tokens_per_step=chunk or len(prompt),
            max_model_len=len(prompt) + 1,
            chunk_size=chunk,
        ),
        implementation="xla",
    )
    [seq] = engine.generate([prompt], SamplingParams(1), record_prompt_logits=True)
    return seq.prompt_logits


def _checkpoint(tmp_path, arch, rng, **config_changes):
    config = hf_config(arch, **config_changes)
    tensors = hf_tensors(config, rng)
    return write_checkpoint(tmp_path / arch, config, tensors), config, tensors


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_architecture_gives_the_hf_forward_logits(tmp_path, arch):
    """Single-shot and chunked prompt logits equal the float64 forward of the same tensors; for
    the variant an architecture exercises (window, rope scaling, biases, qk-norm) the forward
    without it differs by far more than the tolerance, so the variant is really applied."""
    rng = np.random.default_rng(0)
    path, config, tensors = _checkpoint(tmp_path, arch, rng)
    model, model_config = load_pretrained(path)
    assert model_config.dtype == jnp.float32
    prompt = rng.integers(0, config["vocab_size"], PROMPT_LEN).tolist()
    ref = hf_forward(config, tensors, prompt)
    for chunk in (None, 7):
        got = _prompt_logits(model, prompt, chunk)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, ref, atol=F32_LOGIT_TOL, rtol=0, err_msg=f"chunk={chunk}")
    variant = {
        "llama": dict(rope_scaling=None),
        "qwen2": dict(architectures=["LlamaForCausalLM"]),  # Llama: the same without biases
        "qwen3": dict(architectures=["LlamaForCausalLM"]),  # without qk-norm
        "mistral": dict(sliding_window=None),
    }[arch]
    kept = {n: v for n, v in tensors.items() if "bias" not in n and "_norm." not in n}
    other = hf_forward({**config, **variant}, kept if arch.startswith("qwen") else tensors, prompt)
    assert np.max(np.abs(other - ref)) > 100 * F32_LOGIT_TOL


def test_config_fields_per_architecture():
    configs = {arch: config_from_hf(hf_config(arch)) for arch in ARCHS}
    assert configs["llama"].rope_scaling.kind == "llama3"
    assert configs["llama"].rope_scaling.original_max_position == 64
    assert configs["llama"].tie_word_embeddings
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].o_bias
    assert configs["qwen3"].qk_norm and not configs["qwen3"].qkv_bias
    assert configs["mistral"].sliding_window == 8 and configs["mistral"].head_dim == 64
    assert not any(c.qk_norm for a, c in configs.items() if a != "qwen3")
    # transformers 5 writes rope_parameters and dtype instead.
    v5 = hf_config("llama", rope_theta=None, torch_dtype=None, dtype="bfloat16")
    v5["rope_parameters"] = {"rope_theta": 500_000.0, **v5.pop("rope_scaling")}
    c5 = config_from_hf(v5)
    assert c5.rope_theta == 500_000.0 and c5.rope_scaling == configs["llama"].rope_scaling
    assert c5.dtype == jnp.bfloat16 and c5.precision is None


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("requested", [None, "float32", "bfloat16"])
def test_dtypes(tmp_path, stored, requested):
    """Parameters take the requested dtype, else the checkpoint's torch_dtype, whatever dtype
    the tensors are stored in; values are the stored ones, rounded once."""
    rng = np.random.default_rng(1)
    config = hf_config("qwen3", torch_dtype=stored)
    tensors = hf_tensors(config, rng)
    store = {"float32": np.float32, "bfloat16": BFLOAT16}[stored]
    path = write_checkpoint(tmp_path, config, tensors, dtype=store)
    model, model_config = load_pretrained(path, dtype=requested)
    want = jnp.dtype(requested or stored)
    assert model_config.dtype == want
    kernel = model.layers[1].attn.qkv_proj.kernel[...]
    assert kernel.dtype == want
    _, k, _ = split_qkv(kernel, 4, 2, 64)
    expected = tensors["model.layers.1.self_attn.k_proj.weight"].astype(store).astype(want)
    np.testing.assert_array_equal(np.asarray(k), expected.T)


def test_sharded_checkpoint_loads_the_same_parameters(tmp_path):
    rng = np.random.default_rng(2)
    config = hf_config("qwen2")
    tensors = hf_tensors(config, rng)
    one, _ = load_pretrained(write_checkpoint(tmp_path / "one", config, tensors))
    three, _ = load_pretrained(write_checkpoint(tmp_path / "three", config, tensors, shards=3))
    assert len(list((tmp_path / "three").glob("*.safetensors"))) == 3
    a = dict(_flat(one))
    b = dict(_flat(three))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def _flat(model):
    from flax import nnx  # noqa: PLC0415

    return [(tuple(p), np.asarray(v[...])) for p, v in nnx.to_flat_state(nnx.state(model))]


def test_tied_checkpoint_has_no_head_and_ignores_a_saved_one(tmp_path):
    """A tied model's head is its embedding table; an lm_head.weight saved beside it is
    reported by a warning and not used."""
    rng = np.random.default_rng(3)
    path, config, tensors = _checkpoint(tmp_path, "llama", rng)
    model, _ = load_pretrained(path)
    assert model.lm_head is None
    hidden = rng.standard_normal((3, config["hidden_size"])).astype(np.float32)
    embed = tensors["model.embed_tokens.weight"]
    np.testing.assert_allclose(model.logits(jnp.asarray(hidden)), hidden @ embed.T, atol=1e-4)
    tensors["lm_head.weight"] = rng.standard_normal(embed.shape)
    write_checkpoint(path, config, tensors)
    with pytest.warns(UserWarning, match="lm_head.weight"):
        again, _ = load_pretrained(path)
    assert again.lm_head is None


def _bad(tmp_path, case):
    """A model folder with one thing wrong, and the message its error must contain."""
    rng = np.random.default_rng(4)
    config = hf_config("qwen3")
    tensors = hf_tensors(config, rng)
    k = "model.layers.1.self_attn.k_proj.weight"
    if case == "architecture":
        config["architectures"] = ["GPT2LMHeadModel"]
        match = r"config\.json: architectures must be one of .*GPT2LMHeadModel"
    elif case == "missing tensor":
        del tensors[k]
        match = rf"tensor {k} is missing \(expected shape \[128, 128\]\)"
    elif case == "mis-shaped tensor":
        tensors[k] = tensors[k][:64]
        match = rf"model\.safetensors: tensor {k} has shape \[64, 128\].*needs \[128, 128\]"
    elif case == "unused tensor":
        tensors["model.layers.0.mlp.extra_proj.weight"] = tensors[k]
        match = r"1 tensors the model does not use.*extra_proj"
    elif case == "heads":
        config["num_key_value_heads"] = 3
        match = r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"
    elif case == "rope scaling":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
        match = r"rope scaling type must be .* got 'yarn'"
    elif case == "activation":
        config["hidden_act"] = "gelu"
        match = r'hidden_act must be "silu"'
    elif case == "qwen sliding window":
        config["use_sliding_window"] = True
        match = "use_sliding_window is not supported"
    elif case == "dtype":
        config["torch_dtype"] = "float8_e4m3fn"
        match = r"torch_dtype must be one of"
    path = write_checkpoint(tmp_path, config, tensors)
    return path, match


BAD_CASES = [
    "architecture",
    "missing tensor",
    "mis-shaped tensor",
    "unused tensor",
    "heads",
    "rope scaling",
    "activation",
    "qwen sliding window",
    "dtype",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_checkpoints_name_the_file_and_the_rule(tmp_path, case):
    path, match = _bad(tmp_path, case)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load_pretrained(tmp_path)
    config = hf_config("qwen3")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors and no model\.safetensors"):
        load_pretrained(tmp_path)
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"index\.json: names model-00001-of-00002"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not found"):
        load_tokenizer(tmp_path)


def test_eos_ids_prefer_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert eos_token_ids(tmp_path) == (3, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="eos_token_id must be ids"):
        eos_token_ids(tmp_path)


def _text_model(tmp_path, generation_config=None):
    rng = np.random.default_rng(5)
    config = hf_config("qwen2")
    path = write_checkpoint(
        tmp_path, config, hf_tensors(config, rng), generation_config=generation_config
    )
    train_tokenizer(path, vocab_size=config["vocab_size"])
    return path


PROMPT = "The quick brown fox"


def test_cli_streams_the_greedy_continuation(tmp_path, capsys):
    """The printed text is the decoded greedy continuation of the tokenized prompt, which is
    what the engine generates for the same ids."""
    path = _text_model(tmp_path, generation_config={"eos_token_id": 319})
    result = generate.main(["--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "24"])
    printed = capsys.readouterr().out
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode(PROMPT).ids
    model, _ = load_pretrained(path)
    engine = Engine(model, EngineConfig(num_pages=8, max_seqs=1, max_model_len=64))
    [seq] = engine.generate([ids], SamplingParams(24, stop_token_ids=(319,)))
    assert result["output_ids"] == seq.output
    text = tokenizer.decode(seq.output)
    assert text and printed.startswith(PROMPT + text)
    assert result["finish_reason"] == seq.finish_reason


def test_cli_stops_at_the_eos_of_generation_config(tmp_path, capsys):
    """With the model's first greedy token declared EOS, generation stops there."""
    path = _text_model(tmp_path)
    first = generate.main(["--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "4"])
    eos = first["output_ids"][0]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    stopped = generate.main(["--model", str(path), "--prompt", PROMPT, "--max-new-tokens", "4"])
    assert stopped["output_ids"] == [eos] and stopped["finish_reason"] == "stop"
    capsys.readouterr()


def test_prompt_needs_a_model(capsys):
    with pytest.raises(SystemExit):
        generate.main(["--prompt", "hello"])
    assert "--prompt needs --model" in capsys.readouterr().err


def test_loading_does_not_warn_for_a_clean_checkpoint(tmp_path):
    path, _, _ = _checkpoint(tmp_path, "mistral", np.random.default_rng(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_pretrained(path)


def test_e2e_benchmark_takes_a_checkpoint(tmp_path):
    from benchmarks import e2e  # noqa: PLC0415

    path, _, _ = _checkpoint(tmp_path, "qwen2", np.random.default_rng(7))
    cases = e2e.main(["--smoke", "--skip-prefill", "--no-baseline", "--model", str(path)])
    assert cases and all(c["config"] == "qwen2" and c["tokens_per_s"] > 0 for c in cases)
