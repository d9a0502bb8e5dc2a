"""A Llama / Qwen2 / Qwen3 / Mistral decoder over paged KV: RMSNorm, RoPE, GQA through
`jaxpaged.PagedAttention`, SwiGLU MLP; the variants are `ModelConfig` options. Weights are
seeded random, or read from a Hugging Face checkpoint by `models.checkpoint.load_pretrained`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import jaxpaged
from models.config import ModelConfig

KVPages = list[tuple[jax.Array, jax.Array]]  # per layer (k_pages, v_pages) [P, page_size, Hkv, D]


def fuse_gate_up(gate, up) -> jax.Array:
    """Gate and up kernels [hidden, I] -> one [hidden, 2 I] with their columns interleaved
    (gate_0, up_0, gate_1, ...): one matmul, and any split of the columns into equal contiguous
    parts (tensor parallelism) holds matching gate and up columns."""
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def split_gate_up(kernel) -> tuple[jax.Array, jax.Array]:
    """The inverse of `fuse_gate_up`."""
    pairs = kernel.reshape(*kernel.shape[:-1], -1, 2)
    return pairs[..., 0], pairs[..., 1]


# Steps of at most this many tokens (decode batches) take SwiGLU from the float32 gate/up
# product, rounding once after `silu(gate) * up` rather than the product first. At these sizes
# the float32 output is small, and XLA then picks an unsplit GEMM for it where the bfloat16
# product got a split-K GEMM whose partial sums the activation's kernel read: at 64 rows the
# pair took 18.7 us against 21.7 (benchmarks/NOTES.md, session 21). Larger steps keep the
# bfloat16 product: there the float32 one would double the bytes the activation reads.
SWIGLU_F32_MAX_TOKENS = 64


class MLP(nnx.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, with gate and up as one [hidden, 2 I] matrix
    (`fuse_gate_up`) so that they are one matmul; for steps of up to `SWIGLU_F32_MAX_TOKENS`
    tokens the activation takes the matmul's float32 output, and for steps of up to
    `jaxpaged.layers.DECODE_SPLIT_K_MAX_TOKENS` that output comes as split-K partial sums
    (`jaxpaged.layers.split_k_dot`), which the activation's fusion adds up. With
    `partial_sums`, a small step's down projection comes out as such partial sums too
    (`decode_split_k(..., output=True)`, without tensor parallelism), for
    `jaxpaged.add_rms_norm` to sum."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        linear = functools.partial(
            nnx.Linear,
            use_bias=False,
            dtype=config.dtype,
            param_dtype=config.dtype,
            precision=config.precision,
            rngs=rngs,
        )
        self.gate_up_proj = linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: jax.Array, *, partial_sums: bool = False) -> jax.Array:
        proj = self.gate_up_proj
        small = math.prod(x.shape[:-1]) <= SWIGLU_F32_MAX_TOKENS
        x = x.astype(proj.dtype)
        splits = jaxpaged.layers.decode_split_k(x) if x.ndim == 2 else 1
        if splits > 1:  # summed in SwiGLU's fusion
            product = jaxpaged.layers.split_k_dot(x, proj.kernel[...], splits, proj.precision)
            product = product.sum(0)
        else:
            product = jnp.dot(
                x,
                proj.kernel[...],
                precision=proj.precision,
                preferred_element_type=jnp.float32 if small else None,
            )
        gate, up = split_gate_up(product)
        hidden = (jax.nn.silu(gate) * up).astype(proj.dtype)
        splits = 1
        if partial_sums and hidden.ndim == 2 and jaxpaged.layers.tensor_parallel_size() == 1:
            splits = jaxpaged.layers.decode_split_k(hidden, output=True)
        return jaxpaged.layers.split_k_linear(self.down_proj, hidden, splits)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(
            nnx.RMSNorm,
            config.hidden_size,
            epsilon=config.norm_eps,
            dtype=config.dtype,
            param_dtype=config.dtype,
            rngs=rngs,
        )
        self.input_norm = norm()
        self.attn = jaxpaged.PagedAttention(
            config.hidden_size,
            config.num_q_heads,
            config.num_kv_heads,
            config.head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            qk_norm=config.qk_norm,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            sliding_window=config.sliding_window,
            norm_eps=config.norm_eps,
            dtype=config.dtype,
            precision=config.precision,
            rngs=rngs,
        )
        self.post_attention_norm = norm()
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, normed, k_pages, v_pages, meta, *, implementation):
        """x: the residual stream [T, hidden]; normed: `input_norm(x)`. Returns
        `(x + attention, mlp output, k_pages, v_pages)`: the caller adds the MLP's output and
        takes the next norm in one op (`jaxpaged.add_rms_norm`). In a small step the attention
        and MLP outputs may come as float32 split-K partial sums [S, T, hidden], which
        `add_rms_norm` sums."""
        h, k_pages, v_pages = self.attn(
            normed, k_pages, v_pages, meta, implementation=implementation, partial_sums=True
        )
        x, normed = _add_norm(x, h, self.post_attention_norm, implementation)
        return x, self.mlp(normed, partial_sums=True), k_pages, v_pages


def _add_norm(x, h, norm: nnx.RMSNorm, implementation) -> tuple[jax.Array, jax.Array]:
    """`(x + h, norm(x + h))`, h None: `(x, norm(x))`."""
    if h is None:
        return x, norm(x)
    return jaxpaged.add_rms_norm(
        x, h, norm.scale[...], eps=norm.epsilon, implementation=implementation
    )


class Decoder(nnx.Module):
    """Token ids of a ragged batch in, final hidden states out; `logits` maps them to the
    vocabulary (so a step can project only the rows it samples from)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=config.dtype,
            param_dtype=config.dtype,
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = nnx.RMSNorm(
            config.hidden_size,
            epsilon=config.norm_eps,
            dtype=config.dtype,
            param_dtype=config.dtype,
            rngs=rngs,
        )
        # Tied: the head is the embedding table, `logits` multiplies by its transpose.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nnx.Linear(
                config.hidden_size,
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                param_dtype=config.dtype,
                precision=config.precision,
                rngs=rngs,
            )
        )

    def __call__(
        self,
        tokens: jax.Array,
        kv_pages: KVPages,
        meta: jaxpaged.StepMetadata,
        *,
        implementation: str | None = None,
    ) -> tuple[jax.Array, KVPages]:
        """tokens: i32[T] packed like the attention's `q`; kv_pages: one (k, v) per layer.
        Returns the normalized hidden states [T, hidden] and the updated pages."""
        x, h = self.embed(tokens), None
        new_pages = []
        for layer, (k_pages, v_pages) in zip(self.layers, kv_pages, strict=True):
            x, normed = _add_norm(x, h, layer.input_norm, implementation)
            x, h, k_pages, v_pages = layer(
                x, normed, k_pages, v_pages, meta, implementation=implementation
            )
            new_pages.append((k_pages, v_pages))
        return _add_norm(x, h, self.norm, implementation)[1], new_pages

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[N, hidden] -> f32[N, vocab].

        Logits come out of the float32 accumulator unrounded: rounded to bfloat16 they move in
        steps of 2^-6 at |logit| 2-4, so argmax near-ties become exact ties broken by token
        index and one rounding step of the chosen token's logit moves its log-probability by
        0.016 nats.
        """
        if self.lm_head is None:
            weight = self.embed.embedding[...].T
        else:
            weight = self.lm_head.kernel[...]
        return jnp.dot(
            hidden.astype(self.config.dtype),
            weight,
            precision=self.config.precision,
            preferred_element_type=jnp.float32,
        )


def init_kv_pages(config: ModelConfig, num_pages: int, page_size: int) -> KVPages:
    """Empty pages for every layer. They start as NaN so that a read of a slot no token was
    written to shows in the logits instead of passing silently."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    return [
        (jnp.full(shape, jnp.nan, config.dtype), jnp.full(shape, jnp.nan, config.dtype))
        for _ in range(config.num_layers)
    ]
