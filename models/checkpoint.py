"""Hugging Face checkpoints: a local model folder in, a `Decoder` with its weights out.

    model, config = load_pretrained("path/to/Qwen3-0.6B")  # config.json + *.safetensors
    tokenizer = load_tokenizer("path/to/Qwen3-0.6B")  # tokenizer.json
    stop_ids = eos_token_ids("path/to/Qwen3-0.6B")  # generation_config.json / config.json

Architectures: `LlamaForCausalLM` (with Llama 3.1 / 3.2 `rope_scaling` of type "llama3", and
"linear"), `Qwen2ForCausalLM` (q/k/v biases), `Qwen3ForCausalLM` (qk-norm) and
`MistralForCausalLM` (sliding window). Weights come from `model.safetensors` or from the shards
a `model.safetensors.index.json` names, one tensor at a time: each is read, moved to the device
and fused there (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, in the layouts of
`jaxpaged.fuse_qkv` and `models.decoder.fuse_gate_up`, transposed to [in, out]),
so the host never holds more than one layer's tensors beside the device copy.

Every problem raises `CheckpointError` (a `ValueError`) naming the file and the rule: an unknown
architecture, an unsupported option, a head count that does not divide, a missing or mis-shaped
tensor, a tensor the model does not use. The only tensors skipped are those the config makes
redundant (RoPE's `inv_freq` buffers, a tied `lm_head.weight`), and each is reported by a
warning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged import RopeScaling, fuse_qkv
from models import parallel
from models.config import ModelConfig
from models.decoder import Decoder, fuse_gate_up

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_INDEX = "model.safetensors.index.json"
# Buffers older checkpoints saved that the config determines.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


class CheckpointError(ValueError):
    """A model folder this loader cannot read; the message names the file and the rule."""


def read_config(path: str | Path, *, dtype=None) -> ModelConfig:
    """The `ModelConfig` of the model folder `path` (its `config.json`); `dtype` overrides the
    checkpoint's `torch_dtype`."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: not found (a Hugging Face model folder has config.json)")
    return config_from_hf(json.loads(file.read_text()), source=str(file), dtype=dtype)


def config_from_hf(hf: dict, *, source: str = "config.json", dtype=None) -> ModelConfig:
    """A Hugging Face `config.json` (as a dict) as a `ModelConfig`; `source` names it in
    errors. Reads both the transformers 4 keys (`rope_theta`, `rope_scaling`, `torch_dtype`)
    and the transformers 5 ones (`rope_parameters`, `dtype`)."""

    def fail(rule: str):
        raise CheckpointError(f"{source}: {rule}")

    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        fail(f"architectures must be one of {list(ARCHITECTURES)}; got {architectures}")
    arch = architectures[0]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        fail(f'hidden_act must be "silu" (a SwiGLU MLP); got {act!r}')
    if hf.get("mlp_bias"):
        fail("mlp_bias is not supported (no released checkpoint of these architectures has it)")
    if arch.startswith("Qwen") and (
        hf.get("use_sliding_window") or "sliding_attention" in hf.get("layer_types", ())
    ):
        fail("use_sliding_window is not supported for Qwen2/Qwen3 (per-layer windows)")

    num_q_heads = hf["num_attention_heads"]
    num_kv_heads = hf.get("num_key_value_heads") or num_q_heads
    if num_q_heads % num_kv_heads:
        fail(
            f"num_attention_heads ({num_q_heads}) must be a multiple of num_key_value_heads "
            f"({num_kv_heads})"
        )
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hf["hidden_size"] % num_q_heads:
            fail(
                f"without head_dim, hidden_size ({hf['hidden_size']}) must be a multiple of "
                f"num_attention_heads ({num_q_heads})"
            )
        head_dim = hf["hidden_size"] // num_q_heads
    if head_dim % 2:
        fail(f"head_dim must be even for RoPE; got {head_dim}")

    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
    scaling = hf.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    rope_scaling = None
    if kind == "linear":
        rope_scaling = RopeScaling("linear", float(scaling["factor"]))
    elif kind == "llama3":
        rope_scaling = RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    elif kind != "default":
        fail(f'rope scaling type must be "default", "linear" or "llama3"; got {kind!r}')

    attention_bias = bool(hf.get("attention_bias", False))
    if dtype is None:
        name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if name not in DTYPES:
            fail(f"torch_dtype must be one of {list(DTYPES)}; got {name!r}")
        dtype = DTYPES[name]
    config = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=arch == "Qwen3ForCausalLM",
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        rope_scaling=rope_scaling,
        sliding_window=hf.get("sliding_window") if arch == "MistralForCausalLM" else None,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    return config.with_dtype(dtype)


@dataclasses.dataclass(frozen=True)
class _Param:
    """How one of our parameters is made: from these HF tensors (of these shapes), combined."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    combine: Callable[..., jax.Array]


def _linear(weight):  # HF [out, in] -> our [in, out]
    return weight.T


def _vector(weight):
    return weight


def _plan(config: ModelConfig) -> dict[tuple, _Param]:
    """Our parameter paths (as `nnx.to_flat_state` names them) -> their HF tensors."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_q_heads * d, config.num_kv_heads * d
    qkv = functools.partial(fuse_qkv, num_kv_heads=config.num_kv_heads)
    plan = {
        ("embed", "embedding"): _Param(
            ("model.embed_tokens.weight",), ((config.vocab_size, h),), _vector
        ),
        ("norm", "scale"): _Param(("model.norm.weight",), ((h,),), _vector),
    }
    if not config.tie_word_embeddings:
        plan["lm_head", "kernel"] = _Param(("lm_head.weight",), ((config.vocab_size, h),), _linear)
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        attn = f"{hf}self_attn."
        mine = {
            ("input_norm", "scale"): ((f"{hf}input_layernorm.weight",), ((h,),), _vector),
            ("post_attention_norm", "scale"): (
                (f"{hf}post_attention_layernorm.weight",),
                ((h,),),
                _vector,
            ),
            ("attn", "qkv_proj", "kernel"): (
                tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
                ((q, h), (kv, h), (kv, h)),
                lambda *w: qkv(*(x.T for x in w)),
            ),
            ("attn", "o_proj", "kernel"): ((f"{attn}o_proj.weight",), ((h, q),), _linear),
            ("mlp", "gate_up_proj", "kernel"): (
                (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
                ((inter, h), (inter, h)),
                lambda gate, up: fuse_gate_up(gate.T, up.T),
            ),
            ("mlp", "down_proj", "kernel"): (
                (f"{hf}mlp.down_proj.weight",),
                ((h, inter),),
                _linear,
            ),
        }
        if config.qkv_bias:
            mine["attn", "qkv_proj", "bias"] = (
                tuple(f"{attn}{p}_proj.bias" for p in "qkv"),
                ((q,), (kv,), (kv,)),
                qkv,
            )
        if config.o_bias:
            mine["attn", "o_proj", "bias"] = ((f"{attn}o_proj.bias",), ((h,),), _vector)
        if config.qk_norm:
            for p in "qk":
                mine["attn", f"{p}_norm", "scale"] = ((f"{attn}{p}_norm.weight",), ((d,),), _vector)
        for path, (names, shapes, combine) in mine.items():
            plan["layers", i, *path] = _Param(names, shapes, combine)
    return plan


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model folder: the shards its index names, or the one file."""
    index = path / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: needs a non-empty weight_map of tensor -> file")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index}: names {file.name}, which is not in {path}")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(
            f"{path}: no model.safetensors and no {_INDEX} (only safetensors weights load)"
        )
    return [single]


def load_pretrained(
    path: str | Path, *, dtype=None, mesh: jax.sharding.Mesh | None = None
) -> tuple[Decoder, ModelConfig]:
    """The decoder of a local Hugging Face model folder, with its weights, and its config.

    dtype: that of the parameters, activations and KV pages (default: the checkpoint's
      `torch_dtype`); tensors stored in another dtype are converted on the device.
    mesh: a tensor-parallel mesh (`models.parallel.make_mesh`): each parameter is placed split
      over it as soon as it is read.
    """
    from safetensors import safe_open  # noqa: PLC0415 - a dependency only loading needs

    path = Path(path)
    config = read_config(path, dtype=dtype)
    if mesh is not None:
        parallel.check_divisible(config, mesh)
    plan = _plan(config)
    files = _weight_files(path)
    handles = {}
    where: dict[str, Path] = {}
    try:
        for file in files:
            handles[file] = safe_open(str(file), framework="numpy")
            for name in handles[file].keys():
                if name in where:
                    raise CheckpointError(f"{file}: {name} is also in {where[name].name}")
                where[name] = file
        wanted = {
            name: shape
            for p in plan.values()
            for name, shape in zip(p.names, p.shapes, strict=True)
        }
        _check_tensors(path, config, wanted, where, handles)

        def read(name: str) -> jax.Array:
            return jnp.asarray(handles[where[name]].get_tensor(name))

        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        flat = nnx.to_flat_state(state)
        paths = {tuple(p) for p, _ in flat}
        if paths != set(plan):  # the plan and the decoder disagree: a bug here, not the file's
            raise AssertionError(f"unplanned parameters {paths ^ set(plan)}")
        values = {}
        for param_path, variable in flat:
            param = plan[tuple(param_path)]
            value = param.combine(*(read(n) for n in param.names)).astype(config.dtype)
            assert value.shape == variable.shape, (param_path, value.shape, variable.shape)
            if mesh is not None:
                value = jax.device_put(value, parallel.param_sharding(param_path, mesh))
            values[tuple(param_path)] = value
    finally:
        handles.clear()
    nnx.replace_by_pure_dict(state, _nest(values))
    return nnx.merge(graphdef, state), config


def _nest(values: dict[tuple, jax.Array]) -> dict:
    """{(a, b, c): x} -> {a: {b: {c: x}}}, the pure state dict `nnx.replace_by_pure_dict`
    takes."""
    tree: dict = {}
    for path, value in values.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _check_tensors(path, config, wanted, where, handles) -> None:
    """Every tensor the model needs is present with its shape; every other one is redundant
    (reported by a warning) or an error."""
    for name, shape in wanted.items():
        if name not in where:
            raise CheckpointError(
                f"{path}: tensor {name} is missing (expected shape {list(shape)}) from "
                f"{', '.join(sorted({f.name for f in handles}))}"
            )
        found = tuple(handles[where[name]].get_slice(name).get_shape())
        if found != shape:
            raise CheckpointError(
                f"{where[name]}: tensor {name} has shape {list(found)}; the config "
                f"({path / 'config.json'}) needs {list(shape)}"
            )
    unused = sorted(set(where) - set(wanted))
    redundant = [
        n
        for n in unused
        if _DERIVED.fullmatch(n) or (n == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if redundant:
        warnings.warn(
            f"{path}: ignored {len(redundant)} tensors the config makes redundant "
            f"(tie_word_embeddings, RoPE inv_freq): {redundant[:3]}",
            stacklevel=3,
        )
    unknown = [n for n in unused if n not in redundant]
    if unknown:
        raise CheckpointError(
            f"{where[unknown[0]]}: {len(unknown)} tensors the model does not use, e.g. "
            f"{unknown[:5]} (a different architecture or variant than config.json says?)"
        )


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` of a model folder (its `tokenizer.json`)."""
    from tokenizers import Tokenizer  # noqa: PLC0415 - a dependency only the text CLI needs

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(
            f"{file}: not found (the fast tokenizer file; tokenizer.model alone is not read)"
        )
    return Tokenizer.from_file(str(file))


def eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids generation stops at: `eos_token_id` of `generation_config.json`
    if it names one, else of `config.json` (an int or a list); () if neither does."""
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        eos = json.loads(file.read_text()).get("eos_token_id")
        if eos is None:
            continue
        ids = (eos,) if isinstance(eos, int) else tuple(eos)
        if not all(isinstance(i, int) and i >= 0 for i in ids):
            raise CheckpointError(f"{file}: eos_token_id must be ids >= 0; got {eos!r}")
        return ids
    return ()
