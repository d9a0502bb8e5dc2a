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
from pallas_kernels.common import merge_splits

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
# Decode steps of at most this many sequence slots may run the layer kernel
# (`Decoder(layer_kernel=True)`): its products take the rows as `wgmma`'s N of 8.
LAYER_KERNEL_MAX_ROWS = 8
# ... and by default (`layer_kernel=None`) steps of at most this many: on an H100 (session 53,
# unprofiled, phases) B=1 in one slot ran 1.05-1.075x XLA's layers, B=4 0.93x, B=8 0.82x
# (benchmarks/NOTES.md, runs 243-245).
LAYER_KERNEL_DEFAULT_MAX_ROWS = 1
# The layer path's forms on Hopper (`Decoder.layer_form`): "phases" runs a layer's work after
# attention as one kernel a phase (o, gate/up, down, the next qkv), each taking its prologue
# (the split merge, a norm, SwiGLU) first, beside its first weight copies
# (`pallas_kernels.mosaic.layer.post_attention_phases`); "persistent" as one kernel with grid
# barriers between the phases (`post_attention`), which session 48 measured at 46-47 us a
# layer against XLA's 38.5 (benchmarks/NOTES.md, session 52).
LAYER_FORMS = ("phases", "persistent")


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


def norm_qkv(
    x: jax.Array, layer: DecoderLayer, *, kv_lens: jax.Array | None, implementation: str | None
) -> jax.Array:
    """A decode step's first layer up to its attention, for `attend_states`: the input norm of
    x [R, hidden] and the qkv projection as float32 partial sums [parts, R, Hkv, G + 2, D]. One
    Mosaic GPU kernel (`pallas_kernels.mosaic.layer.norm_qkv`: XLA's dot would take a single
    row as multiply + reduce) unless `implementation` is "xla" (the step's own norm and
    split-K dot). Rows of inactive slots (`kv_lens` 0) are undefined."""
    attn, norm = layer.attn, layer.input_norm
    if implementation == "xla":
        return attn._qkv(norm(x), partial=True)
    from pallas_kernels.mosaic import layer as mosaic  # noqa: PLC0415

    qkv = mosaic.norm_qkv(
        x, attn.qkv_proj.kernel[...], norm.scale[...], eps=norm.epsilon, kv_lens=kv_lens
    )
    group = attn.num_q_heads // attn.num_kv_heads
    return qkv.reshape(*qkv.shape[:2], attn.num_kv_heads, group + 2, attn.head_dim)


def post_attention(
    states: tuple[jax.Array, jax.Array],
    x: jax.Array,
    layer: DecoderLayer,
    next_norm: nnx.RMSNorm,
    next_qkv: nnx.Linear | None,
    counters,
    *,
    parity: int,
    kv_lens: jax.Array | None = None,
    implementation: str | None,
) -> tuple[jax.Array, jax.Array]:
    """A decode step's layer after its attention, through the next layer's norm and qkv
    projection: the split merge, o, the residual add and norm, the MLP, the residual add, the
    next norm and the next qkv. Mosaic GPU kernels (`pallas_kernels.mosaic.layer`: one a phase,
    or with `counters` one in all) unless `implementation` is "xla" (the same arithmetic
    in XLA, as the step's own path computes it).

    Args:
      states: the attention's split states (`PagedAttention.attend_states`), S >= R rows.
      x: [R, hidden] the residual stream.
      layer: the layer; next_norm: the next layer's input norm (the last layer: the final
        norm); next_qkv: the next layer's qkv projection (the last layer: None).
      counters: the persistent kernel's barrier counters (`layer_counters`), shared by a
        step's layers, which take `parity` 0 and 1 in turn; None for the other forms.
      kv_lens: the step's; the kernel skips the per-row work of inactive slots (their rows of
        the outputs undefined, of the final norm zero).

    Returns:
      `(x + attention + mlp [R, hidden], qkv)`: qkv float32 partial sums [parts, R, qkv cols]
      of the next layer's projection; the last layer the final norm [R, hidden] instead.
    """
    weights = (
        layer.attn.o_proj.kernel[...],
        layer.mlp.gate_up_proj.kernel[...],
        layer.mlp.down_proj.kernel[...],
    )
    if next_qkv is not None:
        weights += (next_qkv.kernel[...],)
    scales = (layer.post_attention_norm.scale[...], next_norm.scale[...])
    eps = next_norm.epsilon
    if implementation != "xla":
        from pallas_kernels.mosaic import layer as mosaic  # noqa: PLC0415

        if counters is None:
            return mosaic.post_attention_phases(
                states, x, weights, *scales, eps=eps, kv_lens=kv_lens
            )
        return mosaic.post_attention(
            states, x, weights, *scales, counters, parity=parity, eps=eps, kv_lens=kv_lens
        )
    return post_attention_reference(
        states, x, weights, *scales, eps=eps, precision=layer.attn.o_proj.precision
    )


def post_attention_reference(
    states, x, weights, scale_mlp, scale_next, *, eps: float, precision=None
) -> tuple[jax.Array, jax.Array]:
    """`post_attention`'s arithmetic in XLA on the matrices themselves (as
    `pallas_kernels.mosaic.layer.post_attention` takes them), as the step's own path rounds
    it: the split merge, o, h = x + o, its norm, SwiGLU from the float32 gate/up product,
    down, h2 = h + down, the next norm, the next qkv as one float32 part [1, R, cols] (or,
    without a fourth matrix, the final norm)."""

    def dot(a, w):
        return jnp.dot(a, w, precision=precision, preferred_element_type=jnp.float32)

    rows = x.shape[0]
    out, lse = states
    attn, _ = merge_splits(out[:rows], lse[:rows], out_dtype=x.dtype)
    h = x + dot(attn.reshape(rows, -1), weights[0]).astype(x.dtype)
    normed = jaxpaged.layers.rms_norm(h, scale_mlp, eps)
    gate, up = split_gate_up(dot(normed, weights[1]))
    h2 = h + dot((jax.nn.silu(gate) * up).astype(x.dtype), weights[2]).astype(x.dtype)
    normed = jaxpaged.layers.rms_norm(h2, scale_next, eps)
    return h2, normed if len(weights) == 3 else dot(normed, weights[3])[None]


def layer_counters() -> jax.Array:
    """The barrier counters a step's `post_attention` kernels share: a new int32 [3, 3] zero
    ref (`pallas_kernels.mosaic.layer.grid_barrier`)."""
    return jax.new_ref(jnp.zeros((3, 3), jnp.int32))


class Decoder(nnx.Module):
    """Token ids of a ragged batch in, final hidden states out; `logits` maps them to the
    vocabulary (so a step can project only the rows it samples from).

    `layer_kernel`: decode steps of few rows run each layer's work after attention in Mosaic
    GPU kernels (`post_attention`) where they apply (`runs_layer_kernel`): None (the
    default) steps of one row (`LAYER_KERNEL_DEFAULT_MAX_ROWS`) where the kernels run
    (Hopper), True steps of up to 8 rows (`LAYER_KERNEL_MAX_ROWS`), also as the same
    structure in XLA under `implementation="xla"` (the path's reference, for tests), False
    never. `layer_form`: the kernels' form, one of `LAYER_FORMS` (a static attribute,
    so that a jitted step traces each form apart)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        layer_kernel: bool | None = None,
        layer_form: str = "phases",
    ):
        if layer_form not in LAYER_FORMS:
            raise ValueError(f"layer_form must be one of {LAYER_FORMS}; got {layer_form!r}")
        self.config = config
        self.layer_kernel = layer_kernel
        self.layer_form = layer_form
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
        if self.runs_layer_kernel(tokens.shape[0], kv_pages, meta, implementation):
            return self._decode_layer_kernel(tokens, kv_pages, meta, implementation)
        x, h = self.embed(tokens), None
        new_pages = []
        for layer, (k_pages, v_pages) in zip(self.layers, kv_pages, strict=True):
            x, normed = _add_norm(x, h, layer.input_norm, implementation)
            x, h, k_pages, v_pages = layer(
                x, normed, k_pages, v_pages, meta, implementation=implementation
            )
            new_pages.append((k_pages, v_pages))
        return _add_norm(x, h, self.norm, implementation)[1], new_pages

    def runs_layer_kernel(
        self, num_tokens: int, kv_pages: KVPages, meta: jaxpaged.StepMetadata, implementation
    ) -> bool:
        """Whether a step runs `_decode_layer_kernel`: unless `layer_kernel` is False, a
        decode step of at most 8 rows (1 unless `layer_kernel` is True) without shared
        prefixes or tensor parallelism, a model without projection biases; on Hopper where
        the Mosaic GPU decode kernel folds `rope_append` and `pallas_kernels.mosaic.layer`
        takes the shape (bfloat16), or with `layer_kernel` True and `implementation` "xla"
        anywhere (the same structure in XLA: the path's reference)."""
        config = self.config
        if self.layer_kernel is False or not (meta.decode and meta.kv_slots is not None):
            return False
        if meta.prefix_groups is not None or jaxpaged.layers.tensor_parallel_size() > 1:
            return False
        max_rows = LAYER_KERNEL_MAX_ROWS if self.layer_kernel else LAYER_KERNEL_DEFAULT_MAX_ROWS
        if config.qkv_bias or config.o_bias or num_tokens > max_rows:
            return False
        if implementation == "xla":
            return self.layer_kernel is True
        if jax.default_backend() != "gpu" or implementation not in (None, "mosaic"):
            return False
        from pallas_kernels.mosaic import layer as mosaic  # noqa: PLC0415

        group = config.num_q_heads // config.num_kv_heads
        qkv = jax.ShapeDtypeStruct(  # the first layer's projection, as `_qkv` makes it
            (
                jaxpaged.layers.DECODE_SPLIT_K,
                num_tokens,
                config.num_kv_heads,
                group + 2,
                config.head_dim,
            ),
            jnp.float32,
        )
        if not jaxpaged.layers.folds_rope(qkv, *kv_pages[0], meta, implementation):
            return False
        attn, mlp = self.layers[0].attn, self.layers[0].mlp
        for wqkv in (attn.qkv_proj.kernel[...], None):  # a layer, the last layer
            shape = mosaic.model_shape(
                attn.o_proj.kernel[...],
                mlp.gate_up_proj.kernel[...],
                mlp.down_proj.kernel[...],
                wqkv,
                config.head_dim,
            )
            if mosaic.supported(shape, num_tokens, config.dtype) is not None:
                return False
        return True

    def _decode_layer_kernel(self, tokens, kv_pages, meta, implementation):
        """`__call__` for a decode step, each layer's work after attention in one
        `post_attention` call: the first layer's norm and qkv projection (`norm_qkv`), then
        per layer its attention (`attend_states`) and `post_attention`, which hands the next
        layer its qkv projection, and the last the final norm."""
        x = self.embed(tokens)
        group = self.config.num_q_heads // self.config.num_kv_heads
        shape = (x.shape[0], self.config.num_kv_heads, group + 2, self.config.head_dim)
        qkv = norm_qkv(x, self.layers[0], kv_lens=meta.kv_lens, implementation=implementation)
        if self.layer_form not in LAYER_FORMS:
            raise ValueError(f"layer_form must be one of {LAYER_FORMS}; got {self.layer_form!r}")
        persistent = implementation != "xla" and self.layer_form == "persistent"
        counters = layer_counters() if persistent else None
        new_pages = []
        for i, (layer, (k_pages, v_pages)) in enumerate(zip(self.layers, kv_pages, strict=True)):
            states, k_pages, v_pages = layer.attn.attend_states(
                qkv, k_pages, v_pages, meta, implementation=implementation
            )
            new_pages.append((k_pages, v_pages))
            last = i == len(self.layers) - 1
            nxt = None if last else self.layers[i + 1]
            x, out = post_attention(
                states,
                x,
                layer,
                self.norm if last else nxt.input_norm,
                None if last else nxt.attn.qkv_proj,
                counters,
                parity=i % 2,
                kv_lens=meta.kv_lens,
                implementation=implementation,
            )
            if not last:
                qkv = out.reshape(out.shape[0], *shape)
        return out, new_pages

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
