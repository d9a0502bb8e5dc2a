"""Model and engine configurations: `CONFIGS["tiny"]` runs on a CPU in seconds, `CONFIGS["1b"]`
is a ~1B-parameter Llama/Qwen3-shaped decoder for GPU benchmarks; `models.checkpoint` reads a
`ModelConfig` from a Hugging Face model folder."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxpaged import RopeScaling
from jaxpaged.shared_prefix import MIN_SAVED_TOKENS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape and variant; `dtype` is that of its parameters, activations and KV pages.

    The variants real checkpoints need: `qkv_bias` (Qwen2) and `o_bias` (Llama's
    `attention_bias`), `qk_norm` (Qwen3), `rope_scaling` (Llama 3.1 / 3.2), `sliding_window`
    (Mistral: each token attends to itself and the `sliding_window - 1` tokens before it) and
    `tie_word_embeddings` (the output head is the embedding table).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    dtype: jnp.dtype = jnp.float32
    # Matmul precision of the projections. Float32 runs with "highest" (IEEE, like the kernels'
    # float32 dots): GPUs default to TF32, whose 1e-3 errors would differ between chunked and
    # single-shot prefill. 16-bit configs leave it None (the default for their dtype).
    precision: str | None = "highest"

    def with_dtype(self, dtype) -> ModelConfig:
        """This config in `dtype`, with the matching matmul precision."""
        dtype = jnp.dtype(dtype)
        return dataclasses.replace(
            self, dtype=dtype, precision="highest" if dtype == jnp.float32 else None
        )

    def num_params(self) -> int:
        qkv = self.head_dim * (self.num_q_heads + 2 * self.num_kv_heads)
        attn = self.hidden_size * (qkv + self.head_dim * self.num_q_heads)
        attn += qkv * self.qkv_bias + self.hidden_size * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = attn + mlp + 2 * self.hidden_size
        tables = (1 if self.tie_word_embeddings else 2) * self.vocab_size * self.hidden_size
        return self.num_layers * layer + tables + self.hidden_size


CONFIGS: dict[str, ModelConfig] = {
    # D=64 and Hq/Hkv=2: the smallest shapes the kernels' tests cover.
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
    ),
    # Qwen3-like shapes at ~0.94B parameters; D=128 and Hkv=8 as in the H200 anchors.
    "1b": ModelConfig(
        vocab_size=32_000,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=16,
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=jnp.bfloat16,
        precision=None,
    ),
}


# The smallest prompt chunk a default mixed step size is made for: at fewer tokens, a step of
# the 1B decoder reads its weights in about the time it multiplies them on the H200, so a
# smaller step saves little.
MIN_HALVED_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the jitted steps and the page pool. Every array a step sees has a shape fixed by
    these numbers, so the steps compile once.

    page_size: tokens per page.
    num_pages: pages per layer in the pool.
    max_seqs: sequence slots (S of every step; the decode step's T too).
    max_tokens_per_step: token budget of a mixed step (its T): prefill chunks plus decodes.
    mixed_step_tokens: the smaller token counts a mixed step that samples also compiles at; it
      runs at the smallest that holds its chunks (`step_token_counts`), so that a step of one
      1024-token prompt beside the decode rows does not pay for a budget of 2048. None: for
      each halving `max_tokens_per_step / 2**k` of at least `MIN_HALVED_CHUNK` tokens, that
      many plus `max_seqs` (a prompt chunk beside a decode token per other slot); (): none.
      Each is one more compile of the mixed kind.
    max_model_len: most tokens a sequence may hold (prompt + generated); sets pages_per_seq.
    chunk_size: most prompt tokens of one sequence per step (None: the whole budget). Changing
      it does not recompile.
    decode_steps: most decode steps of one block (one jitted `lax.while_loop`, one host sync);
      None runs decode one step and one sync at a time.
    max_stop_tokens: most stop token ids per request.
    prefix_caching: keep the full pages of computed prompts in the pool (a prefix cache,
      `models/prefix_cache.py`) and start each request whose prompt begins with the same tokens
      on them, evicting the least recently used idle pages when pages run out.
    shared_prefix_attention: in decode steps and blocks, find the sequences that share their
      first pages (forked samples, prefix-cache hits; `jaxpaged.find_prefix_groups`) and read
      those pages once per group (`jaxpaged.shared_prefix_decode_attention`). Not for models
      with a sliding window.
    shared_prefix_min_tokens: a step takes the shared-prefix path when it saves at least this
      many KV tokens per layer and KV head (`find_prefix_groups`' `min_saved_tokens`); other
      steps run plain decode.
    max_prefix_group: most sequences per group; None: the most every decode backend takes for
      the model (`jaxpaged.default_max_group_size`).
    max_prefix_groups: most groups a decode step reads prefixes once for (`jaxpaged.plan_cascade`'s
      `max_groups`); None: every group a step may have (max_seqs // 2). Each costs the prefix
      call work whether a group fills it or not: rollouts of n samples per prompt set
      `max_seqs // n`. Groups past it read their prefixes as sequences that share nothing.
    """

    page_size: int = 16
    num_pages: int = 512
    max_seqs: int = 8
    max_tokens_per_step: int = 256
    mixed_step_tokens: tuple[int, ...] | None = None
    max_model_len: int = 1024
    chunk_size: int | None = None
    decode_steps: int | None = 16
    max_stop_tokens: int = 4
    prefix_caching: bool = False
    shared_prefix_attention: bool = True
    shared_prefix_min_tokens: int = MIN_SAVED_TOKENS
    max_prefix_group: int | None = None
    max_prefix_groups: int | None = None

    def __post_init__(self):
        if self.decode_steps is not None and self.decode_steps < 1:
            raise ValueError(f"decode_steps must be None or >= 1; got {self.decode_steps}")
        if self.max_stop_tokens < 1:
            raise ValueError(f"max_stop_tokens must be >= 1; got {self.max_stop_tokens}")
        if self.shared_prefix_min_tokens < 0:
            raise ValueError(
                f"shared_prefix_min_tokens must be >= 0; got {self.shared_prefix_min_tokens}"
            )
        if self.max_prefix_groups is not None and self.max_prefix_groups < 1:
            raise ValueError(
                f"max_prefix_groups must be None or >= 1; got {self.max_prefix_groups}"
            )
        tokens = self.mixed_step_tokens or ()
        if any(not 0 < n <= self.max_tokens_per_step for n in tokens):
            raise ValueError(
                f"mixed_step_tokens must lie in [1, max_tokens_per_step="
                f"{self.max_tokens_per_step}]; got {self.mixed_step_tokens}"
            )
        if self.max_prefix_group is not None and self.max_prefix_group < 2:
            raise ValueError(
                f"max_prefix_group must be None or >= 2 (a group of one shares nothing); got "
                f"{self.max_prefix_group}"
            )

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def step_token_counts(self) -> tuple[int, ...]:
        """The token counts (T) of the mixed steps that sample, ascending; the last is
        `max_tokens_per_step`."""
        budget, tokens = self.max_tokens_per_step, self.mixed_step_tokens
        if tokens is None:
            halvings = (budget >> k for k in range(1, budget.bit_length()))
            tokens = [n + self.max_seqs for n in halvings if n >= MIN_HALVED_CHUNK]
        return tuple(sorted({n for n in tokens if n < budget} | {budget}))
