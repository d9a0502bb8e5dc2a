"""A decoder that continues repeated text, for tests that compare greedy continuations.

A randomly initialised decoder predicts every next token with a near-flat distribution: the
bfloat16 roundings that chunked and single-shot prefill apply in different places flip its
near-ties, so their greedy continuations cannot be asked to agree. A real LLM is confident
about most next tokens. `induction_decoder` gives the tiny decoder that property on one task,
continuing a repeated segment of tokens (`induction_prompt`), which it solves by attention over
the whole context:

  layer 0, head 0, a previous-token head: its query and key come from a direction that every
    token embedding shares, rotated so that RoPE makes their product peak at distance 1. It
    copies the previous token's match code (the first D/2 dimensions of its token code) into
    the residual.
  layer 1, head 0, an induction head: its query is the current token's match code, its key the
    copied one, so it attends to every position that followed an earlier occurrence of the
    current token and writes that position's token code, which the LM head reads out.

Residual layout [token code: D | copied match code: D/2 | shared direction: the rest]. The
match codes live in the slow half of the RoPE pairs, which turn by at most 1e-3 radians per
position at theta 1e6, so matching barely depends on distance. Every weight outside the circuit
keeps `Decoder`'s seeded random value times `noise`, so that all of the model's weights take
part in the computation: the MLPs, and the other heads, whose attention stays soft, so that
rounding differences between chunked and single-shot prefill can still show.

The weights are set, not trained. Adam on this task, in-process on a 2-core CPU, stayed at
50-65% next-token accuracy after 2,000-4,000 steps (45-110 s; the plateau before an induction
head forms), while this construction takes milliseconds, gives the same weights on every
platform, and its margins follow from the gains below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpaged
from models.config import ModelConfig
from models.decoder import Decoder

BOS = 0  # begins every prompt; never part of a segment, so it matches no query

# Weights of the previous-token head's RoPE pairs, fastest first: 0.7**i over the fast half
# keeps its score at distance 1 above that at every other distance up to 1,024 by 0.2 of the
# peak (weights falling by 0.5 or 0.8 per pair: 0.13 and 0.15).
_POSITION_DECAY = 0.7
# q_norm/k_norm scale of both circuit layers: attention logits are 8 * gain**2 * cosine for
# D = 64, so the previous-token head leads by 0.2 * 128 = 26 and the induction head by
# 128 * (1 - 0.63) = 47 (0.63: the largest cosine between two of a 24-token segment's match
# codes, random 32-dim vectors, in 99% of segments; the median is 0.47).
_QK_GAIN = 4.0
# The induction head writes the next token's code at 4 times the current token's. The LM head
# then gives the next token a logit of ~10 and any other at most ~5 (token codes are random
# 64-dim vectors, each with a largest cosine of ~0.5 to another): probability ~0.93 on average,
# as for a confident LLM. Twice the gain doubles the margins but puts the probabilities within
# 1e-4 of 1, where log-probabilities no longer show rounding drift.
_OUT_GAIN = 4.0
_LM_GAIN = 1.0


def induction_prompt(length: int, period: int, seed: int, vocab_size: int) -> list[int]:
    """`BOS`, then `period` distinct random tokens repeated: `length` tokens in all.

    The continuation is the repetition's. It is determined once the prompt holds a whole
    segment and the segment's first token again (`length >= period + 2`).
    """
    rng = np.random.default_rng(seed)
    segment = rng.choice(np.arange(1, vocab_size), period, replace=False)
    return [BOS, *np.resize(segment, length - 1).tolist()]


def induction_decoder(config: ModelConfig, *, seed: int = 0, noise: float = 0.25) -> Decoder:
    """The circuit of the module docstring in a `Decoder` of `config` (any dtype).

    The weights are built in float32 and cast to `config.dtype`: a bfloat16 model is the
    float32 one rounded. `seed` draws the random weights and the token codes; `noise` scales
    the random weights outside the circuit: at 0.25, every position of 10 random prompts per
    period (3 to 24 tokens; up to 1,024 positions) predicts the repetition, with a top-1/top-2
    logit margin of at least 3.9; at 0.5, 1% of them are mispredicted.
    """
    hidden, head_dim, half = config.hidden_size, config.head_dim, config.head_dim // 2
    if config.num_layers < 2 or hidden - head_dim - half < 1 or head_dim % 4:
        raise ValueError(
            "the induction circuit needs two layers, hidden_size > 1.5 * head_dim and "
            f"head_dim % 4 == 0; got {config}"
        )
    code = slice(0, head_dim)  # the token code; its first half is the match code
    match = slice(0, half)
    copied = slice(head_dim, head_dim + half)  # the previous token's match code
    shared = slice(head_dim + half, hidden)  # the same in every embedding
    # Dimensions of head 0's q and k: RoPE turns pair (i, i + D/2) by theta**(-i / (D/2)) per
    # position; the fast pairs serve position, the slow ones content.
    fast = np.arange(half // 2)
    slow = np.r_[half // 2 : half, half + half // 2 : head_dim]
    omega = config.rope_theta ** (-fast / half)

    f32 = Decoder(config.with_dtype(jnp.float32), rngs=nnx.Rngs(seed))
    w = jax.tree_util.tree_map_with_path(
        lambda path, x: np.array(x) * (1.0 if path[-1].key == "scale" else noise),
        nnx.to_pure_dict(nnx.state(f32, nnx.Param)),
    )
    rng = np.random.default_rng(seed)
    # Codes of norm sqrt(D): every residual entry of the circuit is ~1, like an RMSNorm output.
    tokens = rng.standard_normal((config.vocab_size, head_dim))
    tokens *= np.sqrt(head_dim) / np.linalg.norm(tokens, axis=1, keepdims=True)
    direction = rng.standard_normal(hidden - head_dim - half)
    direction *= np.sqrt(head_dim) / np.linalg.norm(direction)
    w["embed"]["embedding"][:, code] += tokens
    w["embed"]["embedding"][:, shared] += direction

    # Previous-token head: k = a and q = a * exp(-i omega) per fast pair make the score after
    # RoPE sum_i a_i**2 cos(omega_i (distance - 1)).
    amp = np.sqrt(_POSITION_DECAY**fast / np.sum(_POSITION_DECAY**fast))
    q, k = np.zeros(head_dim), np.zeros(head_dim)
    k[fast] = amp
    q[fast], q[half + fast] = amp * np.cos(omega), -amp * np.sin(omega)
    unit = direction / (direction @ direction) * np.sqrt(head_dim)  # q and k entries ~1
    for layer in w["layers"].values():
        _split_qkv(layer["attn"], config)
    attn = w["layers"][0]["attn"]
    attn["q_proj"]["kernel"][shared, :head_dim] += np.outer(unit, q)
    attn["k_proj"]["kernel"][shared, :head_dim] += np.outer(unit, k)
    attn["v_proj"]["kernel"][match, :half] += np.eye(half)
    attn["o_proj"]["kernel"][:half, copied] += np.eye(half)
    _sharpen(attn, np.r_[fast, half + fast], config)

    # Induction head: match codes in the slow pairs, the token code as value.
    attn = w["layers"][1]["attn"]
    attn["q_proj"]["kernel"][match, slow] += np.eye(half)
    attn["k_proj"]["kernel"][copied, slow] += np.eye(half)
    attn["v_proj"]["kernel"][code, :head_dim] += np.eye(head_dim)
    attn["o_proj"]["kernel"][:head_dim, code] += _OUT_GAIN * np.eye(head_dim)
    _sharpen(attn, slow, config)
    w["lm_head"]["kernel"][code] += _LM_GAIN / np.sqrt(head_dim) * tokens.T
    for layer in w["layers"].values():
        attn = layer["attn"]
        q, k, v = (attn.pop(name)["kernel"] for name in ("q_proj", "k_proj", "v_proj"))
        attn["qkv_proj"] = {"kernel": np.asarray(jaxpaged.fuse_qkv(q, k, v, config.num_kv_heads))}

    model = Decoder(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, config.dtype), w))
    nnx.update(model, state)
    return model


def _split_qkv(attn: dict, config: ModelConfig) -> None:
    """Replace the fused `qkv_proj` kernel by `q_proj`, `k_proj` and `v_proj` ones to edit."""
    qkv = attn.pop("qkv_proj")["kernel"]
    parts = jaxpaged.split_qkv(qkv, config.num_q_heads, config.num_kv_heads, config.head_dim)
    for name, cols in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
        attn[name] = {"kernel": np.array(cols)}


def _sharpen(attn: dict, dims: np.ndarray, config: ModelConfig) -> None:
    """Scale head 0's q and k by `_QK_GAIN` in `dims` (through q_norm and k_norm, whose scales
    all heads share) and take `dims` out of the other heads' q and k.

    The other heads keep attention as soft as the random decoder's: with the gain their random
    scores would grow 16-fold and every head would attend to one key, whose value passes
    through exactly however prefill is split, hiding the rounding that the bf16 test compares.
    """
    for norm in ("q_norm", "k_norm"):
        attn[norm]["scale"][dims] = _QK_GAIN
    for proj, num_heads in (("q_proj", config.num_q_heads), ("k_proj", config.num_kv_heads)):
        per_head = attn[proj]["kernel"].reshape(config.hidden_size, num_heads, config.head_dim)
        per_head[:, 1:, dims] = 0.0
