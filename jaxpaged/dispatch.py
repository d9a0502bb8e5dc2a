"""Which backend runs each attention op: one table, and the rules `implementation=None` follows.

Every row of `TABLE` names an op ("ragged": `ragged_paged_attention`, "decode":
`paged_decode_attention`), a backend (the `implementation=` value), the function that runs it,
where it runs, and when `implementation=None` may pick it. `None` takes the first row of the op,
in table order, that is available on the device and whose rule accepts the call; the reference
("xla") comes last and accepts everything. Removing a backend is removing its folder and rows.

Kernel modules are imported on first use, so that a missing or broken lowering never stops
`import jaxpaged`. The README's backend table is this table (`backend_table()`, checked by
tests/test_readme.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import device_num_sms

OPS = {"ragged": "ragged_paged_attention", "decode": "paged_decode_attention"}
# On Hopper, decode batches whose page-table rows hold at most this many tokens, with more
# than `_ITEMS_PER_SM` (sequence, KV head) pairs per SM, run faster in the Triton kernel's
# small programs than in the Mosaic kernel's persistent ones (benchmarks/NOTES.md).
_SHORT_CONTEXT = 512
_ITEMS_PER_SM = 2


class Device(NamedTuple):
    """What the rules know of a device."""

    platform: str  # "gpu", "cpu", "tpu"
    compute_capability: str | None  # "9.0" on Hopper; None off-GPU
    num_sms: int | None


def default_device() -> Device:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return Device(device.platform, None, None)
    return Device("gpu", getattr(device, "compute_capability", None), device_num_sms())


class Call(NamedTuple):
    """The static facts of a call that the rules look at; None where the caller did not say.
    `max_kv_len` is the tokens a page-table row holds (pages_per_seq * page_size)."""

    dtype: jnp.dtype
    head_dim: int | None = None
    page_size: int | None = None
    num_seqs: int | None = None
    num_kv_heads: int | None = None
    max_kv_len: int | None = None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One row of the table.

    Attributes:
      op, name: the op and the `implementation=` value.
      target: "module:function" of the implementation. It takes the op's arrays and
        `sm_scale`, `sliding_window`, `logits_soft_cap` (and `causal` for "ragged"), and, if
        `tuned`, also `config`, `interpret` (and `short_sequences` for "ragged", `num_splits`
        for "decode"); it returns `(out, lse)`.
      gpu_only: available only on a GPU (else anywhere: kernels in Pallas interpret mode).
      runs_on: where it runs, in words.
      picks: whether `implementation=None` may take it for a call on a device.
      when: `picks` in words.
    """

    op: str
    name: str
    target: str
    tuned: bool
    gpu_only: bool
    runs_on: str
    picks: Callable[[Call, Device], bool]
    when: str


def many_short_sequences(num_seqs: int, num_kv_heads: int, max_kv_len: int, num_sms: int) -> bool:
    """A decode batch of many short sequences (`max_kv_len` tokens per page-table row at most
    `_SHORT_CONTEXT`, more than `_ITEMS_PER_SM` (sequence, KV head) pairs per SM)."""
    return max_kv_len <= _SHORT_CONTEXT and num_seqs * num_kv_heads > _ITEMS_PER_SM * num_sms


def _mosaic_takes(call: Call, device: Device) -> bool:
    """On sm90, the inputs the Mosaic GPU kernels take with their default configs (a head dim
    or page size the caller did not give counts as taken)."""
    from pallas_kernels.mosaic import common

    head_dim = call.head_dim or 128
    return (
        device.compute_capability == "9.0"
        and jnp.dtype(call.dtype) in common.DTYPES
        and common.takes(head_dim, call.page_size or 16, common.default_block_kv(head_dim))
    )


def _mosaic_decode(call: Call, device: Device) -> bool:
    if not _mosaic_takes(call, device):
        return False
    shape = (call.num_seqs, call.num_kv_heads, call.max_kv_len)
    return None in shape or not many_short_sequences(*shape, device.num_sms)


def _on_gpu(call: Call, device: Device) -> bool:
    return device.platform == "gpu"


def _always(call: Call, device: Device) -> bool:
    return True


_MOSAIC_RUNS_ON = "Hopper (sm90) GPUs; bf16/f16"
_TRITON_RUNS_ON = "CUDA GPUs (sm80+); elsewhere in Pallas interpret mode"
_MOSAIC_TAKES = (
    "on sm90 for bf16/f16 inputs with D a multiple of 64 up to 256 and a page size that is "
    "a multiple of 8 dividing 128 (64 at D=256)"
)

TABLE: tuple[Backend, ...] = (
    Backend(
        "ragged",
        "mosaic",
        "pallas_kernels.mosaic.ragged_prefill:ragged_paged_attention",
        tuned=True,
        gpu_only=True,
        runs_on=_MOSAIC_RUNS_ON,
        picks=_mosaic_takes,
        when=_MOSAIC_TAKES,
    ),
    Backend(
        "ragged",
        "triton",
        "pallas_kernels.triton.ragged_prefill:ragged_paged_attention",
        tuned=True,
        gpu_only=False,
        runs_on=_TRITON_RUNS_ON,
        picks=_on_gpu,
        when="on CUDA GPUs, for what the rows above do not take",
    ),
    Backend(
        "ragged",
        "xla",
        "jaxpaged.reference:ragged_paged_attention_reference",
        tuned=False,
        gpu_only=False,
        runs_on="anywhere (plain `jnp`: the spec and the test oracle)",
        picks=_always,
        when="otherwise: on CPUs and other non-GPU devices",
    ),
    Backend(
        "decode",
        "mosaic",
        "pallas_kernels.mosaic.paged_decode:paged_decode_attention",
        tuned=True,
        gpu_only=True,
        runs_on=_MOSAIC_RUNS_ON,
        picks=_mosaic_decode,
        when=(
            f"{_MOSAIC_TAKES}, except for batches of many short sequences: at most "
            f"{_SHORT_CONTEXT} tokens per page-table row and more than {_ITEMS_PER_SM} "
            "(sequence, KV head) pairs per SM"
        ),
    ),
    Backend(
        "decode",
        "triton",
        "pallas_kernels.triton.paged_decode:paged_decode_attention",
        tuned=True,
        gpu_only=False,
        runs_on=_TRITON_RUNS_ON,
        picks=_on_gpu,
        when="on CUDA GPUs, for what the rows above do not take",
    ),
    Backend(
        "decode",
        "xla",
        "jaxpaged.reference:paged_decode_attention_reference",
        tuned=False,
        gpu_only=False,
        runs_on="anywhere (plain `jnp`: the spec and the test oracle)",
        picks=_always,
        when="otherwise: on CPUs and other non-GPU devices",
    ),
)


def backends(op: str) -> tuple[Backend, ...]:
    """The rows of `op`, best first."""
    if op not in OPS:
        raise ValueError(f"op must be one of {tuple(OPS)}; got {op!r}")
    return tuple(row for row in TABLE if row.op == op)


def _row(op: str, name: str) -> Backend:
    [row] = [row for row in backends(op) if row.name == name]
    return row


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def available(op: str, device: Device) -> tuple[str, ...]:
    """Backends of `op` that run on `device`, best first."""
    return tuple(
        row.name
        for row in backends(op)
        if (device.platform == "gpu" or not row.gpu_only)
        and _module_exists(row.target.split(":")[0])
    )


def choose(op: str, call: Call, device: Device) -> str:
    """The backend `implementation=None` runs for `call` on `device`."""
    names = available(op, device)
    for row in backends(op):
        if row.name in names and row.picks(call, device):
            return row.name
    raise AssertionError(f"no row of {op!r} accepts {call}")  # the reference accepts all


@functools.cache
def load(op: str, name: str) -> Callable[..., Any]:
    """The function of row (op, name), imported on first use."""
    module, function = _row(op, name).target.split(":")
    return getattr(importlib.import_module(module), function)


def tuned(op: str, name: str) -> bool:
    """Whether the backend takes `config` and `interpret` (see `Backend.target`)."""
    return _row(op, name).tuned


def backend_table() -> str:
    """`TABLE` as the README's Markdown table."""
    lines = [
        "| op | `implementation=` | runs on | `implementation=None` picks it |",
        "| --- | --- | --- | --- |",
    ]
    for row in TABLE:
        lines.append(f'| `{OPS[row.op]}` | `"{row.name}"` | {row.runs_on} | {row.when} |')
    return "\n".join(lines)
