"""Small Hugging Face checkpoints written from scratch, and their forward pass in float64 numpy.

`write_checkpoint` lays random tensors out under Hugging Face's names and shapes (`[out, in]`
matrices, separate q/k/v and gate/up) with a `config.json`, so the loader is tested against the
file format and not against its own inverse; `hf_forward` is the oracle of the CPU tests,
written from the transformers modeling code of each architecture (RMSNorm, RoPE with its
scalings, GQA with the sliding window, SwiGLU), independently of `models/`.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

# Tiny configs, one per architecture, with the variant each one exercises. head_dim 64: the
# smallest the GPU kernels take. Mistral has no head_dim key (hidden_size / heads).
BASE = dict(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    torch_dtype="float32",
    tie_word_embeddings=False,
    eos_token_id=1,
)
ARCHS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        # Llama 3.2's scaling, with an original context short enough that the test's positions
        # cross the blended band.
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        tie_word_embeddings=True,
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1e6),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1e6),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        hidden_size=256,
        head_dim=None,
        rope_theta=10_000.0,
        sliding_window=8,
    ),
}


def hf_config(arch: str, **overrides) -> dict:
    """The config.json dict of the tiny `arch` model (keys set to None are dropped)."""
    config = {**BASE, **ARCHS[arch], **overrides}
    return {k: v for k, v in config.items() if v is not None}


def _head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def hf_tensors(config: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random float64 tensors of the model `config` describes, by their Hugging Face names.

    Norm scales are near 1 and biases nonzero (not transformers' initial ones and zeros), so
    that a scale or bias taken from the wrong tensor changes the logits."""
    arch = config["architectures"][0]
    h, inter, d = config["hidden_size"], config["intermediate_size"], _head_dim(config)
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def matrix(out, fan_in):
        return rng.standard_normal((out, fan_in)) / np.sqrt(fan_in)

    def scale(n):
        return 1 + 0.2 * rng.standard_normal(n)

    # Embeddings of norm ~2: a tied head then gives logits of magnitude ~2-10 as the untied one.
    embed = 2 / np.sqrt(h) * rng.standard_normal((config["vocab_size"], h))
    t = {"model.embed_tokens.weight": embed}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = scale(h)
        t[p + "post_attention_layernorm.weight"] = scale(h)
        for name, out in (("q", q), ("k", kv), ("v", kv)):
            t[f"{p}self_attn.{name}_proj.weight"] = matrix(out, h)
            if arch == "Qwen2ForCausalLM" or config.get("attention_bias"):
                t[f"{p}self_attn.{name}_proj.bias"] = 0.5 * rng.standard_normal(out)
        t[p + "self_attn.o_proj.weight"] = matrix(h, q)
        if arch != "Qwen2ForCausalLM" and config.get("attention_bias"):
            t[p + "self_attn.o_proj.bias"] = 0.5 * rng.standard_normal(h)
        if arch == "Qwen3ForCausalLM":
            t[p + "self_attn.q_norm.weight"] = scale(d)
            t[p + "self_attn.k_norm.weight"] = scale(d)
        t[p + "mlp.gate_proj.weight"] = matrix(inter, h)
        t[p + "mlp.up_proj.weight"] = matrix(inter, h)
        t[p + "mlp.down_proj.weight"] = matrix(h, inter)
    t["model.norm.weight"] = scale(h)
    if not config.get("tie_word_embeddings"):
        t["lm_head.weight"] = matrix(config["vocab_size"], h)
    return t


def write_checkpoint(
    path: Path,
    config: dict,
    tensors: dict[str, np.ndarray],
    *,
    dtype=np.float32,
    shards: int = 1,
    generation_config: dict | None = None,
) -> Path:
    """A model folder: `config.json`, the tensors in `dtype` as `model.safetensors` or as
    `shards` files with a `model.safetensors.index.json`, and `generation_config.json`."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    arrays = {k: np.ascontiguousarray(v.astype(dtype)) for k, v in tensors.items()}
    if shards == 1:
        save_file(arrays, str(path / "model.safetensors"))
        return path
    names = sorted(arrays)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: arrays[n] for n in names[s::shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


BFLOAT16 = ml_dtypes.bfloat16


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w


def _inv_freq(config: dict) -> np.ndarray:
    """transformers' `ROPE_INIT_FUNCTIONS` for "default", "linear" and "llama3"."""
    d = _head_dim(config)
    inv = 1.0 / config.get("rope_theta", 10_000.0) ** (np.arange(0, d, 2) / d)
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, smoothed, scaled)
    return inv


def _rope(x, positions, inv_freq):  # x [L, H, D]; rotate_half
    angles = positions[:, None] * inv_freq[None]
    emb = np.concatenate([angles, angles], axis=-1)[:, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def hf_forward(config: dict, tensors: dict[str, np.ndarray], tokens) -> np.ndarray:
    """float64 logits [L, vocab] of one sequence, as transformers computes them (eager)."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    arch = config["architectures"][0]
    eps, d = config["rms_norm_eps"], _head_dim(config)
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    tokens = np.asarray(tokens)
    length = len(tokens)
    pos = np.arange(length, dtype=np.float64)
    inv_freq = _inv_freq(config)
    visible = pos[:, None] >= pos[None, :]
    window = config.get("sliding_window") if arch == "MistralForCausalLM" else None
    if window:
        visible &= pos[None, :] > pos[:, None] - window
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], eps)

        def proj(name, heads, h=h, p=p):
            y = h @ t[f"{p}self_attn.{name}_proj.weight"].T
            y = y + t.get(f"{p}self_attn.{name}_proj.bias", 0)
            return y.reshape(length, heads, d)

        q, k, v = proj("q", hq), proj("k", hkv), proj("v", hkv)
        if arch == "Qwen3ForCausalLM":
            q = _rms(q, t[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, t[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, pos, inv_freq), _rope(k, pos, inv_freq)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(length, hq * d)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T + t.get(p + "self_attn.o_proj.bias", 0)
        h = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    x = _rms(x, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T


def train_tokenizer(path: Path, vocab_size: int, eos: str = "<eos>") -> None:
    """A byte-level BPE `tokenizer.json` trained on a few sentences, with `eos` as token 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [
        "Paged attention keeps the cache of every sequence in fixed-size pages.",
        "A chunk of the prompt is appended to the cached prefix of its sequence.",
        "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
        "Décodage: les caches sont paginés, même pour les séquences très longues.",
    ]
    tokenizer.train_from_iterator(text * 4, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
