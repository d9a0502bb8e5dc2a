"""Tensor parallelism with `jax.sharding`: a mesh with a `"tp"` axis splits every layer's heads
and MLP columns over devices (Megatron-style).

    mesh = make_mesh(2)                      # jax.make_mesh((2,), ("tp",)), Auto axes
    engine = Engine(model, config, mesh=mesh)

Column-parallel: `qkv_proj` (KV-group-major, so each device holds whole GQA groups) and
`gate_up_proj` (gate/up interleaved); row-parallel: `o_proj` and `down_proj`, whose partial
sums XLA all-reduces (one all-reduce each per layer). KV pages are split by KV head; the
embedding, norms, output head, page pool and step inputs are replicated. The attention op
and the K/V append run per device inside `shard_map` (`jaxpaged.PagedAttention`).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged import TP_AXIS
from models.config import ModelConfig

# Parameter path suffix -> how it is split (anything else is replicated).
_SPECS = {
    ("attn", "qkv_proj", "kernel"): P(None, TP_AXIS),
    ("attn", "qkv_proj", "bias"): P(TP_AXIS),
    ("attn", "o_proj", "kernel"): P(TP_AXIS, None),
    ("mlp", "gate_up_proj", "kernel"): P(None, TP_AXIS),
    ("mlp", "down_proj", "kernel"): P(TP_AXIS, None),
}
KV_PAGES_SPEC = P(None, None, TP_AXIS, None)  # [P, page_size, Hkv, D]: split by KV head


def make_mesh(tp: int, devices=None) -> Mesh:
    """A one-axis `"tp"` mesh over the first `tp` of `devices` (default: this backend's), with
    an Auto axis: XLA's sharding propagation places the activations."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tp must be in [1, {len(devices)}] (the devices given); got {tp}")
    return jax.make_mesh((tp,), (TP_AXIS,), axis_types=(AxisType.Auto,), devices=devices[:tp])


def check_divisible(config: ModelConfig, mesh: Mesh) -> None:
    """Raise `ValueError` unless the config's heads and MLP split evenly over the mesh."""
    tp = mesh.shape.get(TP_AXIS)
    if tp is None:
        raise ValueError(f"the mesh needs a {TP_AXIS!r} axis; it has {mesh.axis_names}")
    for name, value in (
        ("num_kv_heads", config.num_kv_heads),
        ("num_q_heads", config.num_q_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tp:
            raise ValueError(
                f"{name} {value} must be a multiple of the {TP_AXIS!r} mesh axis ({tp} devices)"
            )


def param_sharding(path: tuple, mesh: Mesh) -> NamedSharding:
    """The sharding of the parameter at `path` (as `nnx.to_flat_state` names it)."""
    return NamedSharding(mesh, _SPECS.get(tuple(path[-3:]), P()))


def shard_params(state: nnx.State, mesh: Mesh) -> nnx.State:
    """`state` with every parameter placed by `param_sharding` (updated in place)."""
    tree: dict = {}
    for path, variable in nnx.to_flat_state(state):
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jax.device_put(variable[...], param_sharding(path, mesh))
    nnx.replace_by_pure_dict(state, tree)
    return state
