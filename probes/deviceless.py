"""Probe: XLA's compiled GPU program for an H200, on a machine with no GPU.

XLA compiles for a GPU it is not attached to when it is given the device's description (a
`GpuTargetConfigProto`, `probes/h200_target.txtpb`) through a compile-only topology of the CUDA
PJRT plugin. What that gives on the CPU is the optimized HLO: which fusions XLA makes, so which
kernels a step launches, and how it compiles a dot (a GEMM fusion, or the multiply + reduce of
one row). It does not give times, and GEMM configs are not autotuned. Session 48 checked it
against run 209's CUPTI kernels of the B=1 decode block (benchmarks/NOTES.md).

The plugin, without the NVIDIA libraries (~1 GB in all, not a dependency of the package;
`make test` makes this environment, `build/deviceless`):

    pip install -c constraints.txt jax jaxlib flax numpy safetensors tokenizers
    pip install -c constraints.txt --no-deps jax-cuda13-plugin jax-cuda13-pjrt
    JAX_PLATFORMS=cpu python -m probes.deviceless --batch 1 [--no-layer-kernel] [--dump F]

It lists the kernels of one decode step of the engine's block (the `while` body and its
condition), then counts them by kind.
"""

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path

import jax
from flax import nnx
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from benchmarks.common import roomy_engine_config
from jaxpaged import dispatch
from models import engine as engine_module
from models.config import CONFIGS
from models.decoder import LAYER_FORMS, Decoder
from models.engine import Engine

TARGET = Path(__file__).with_name("h200_target.txtpb")
# HLO ops that launch nothing of their own: structure, aliases, and the loops and branches
# whose computations `kernels` walks into.
NO_LAUNCH = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "add-dependency", "copy-start", "copy-done", "async-start", "async-done",
    "while", "conditional", "call",
}  # fmt: skip


def hopper_device():
    """A compile-only CUDA device described by `TARGET` (an H200: sm_90, 132 SMs)."""
    try:
        topology = topologies.get_topology_desc(
            "h200", "cuda", target_config=TARGET.read_text(), topology="1x1x1"
        )
    except Exception as e:
        raise RuntimeError(
            "no compile-only CUDA topology: install the CUDA PJRT plugin without its NVIDIA "
            f"libraries (`pip install --no-deps jax-cuda13-plugin=={jax.__version__} "
            f"jax-cuda13-pjrt=={jax.__version__}`) and run with JAX_PLATFORMS=cpu"
        ) from e
    return topology.devices[0]


@contextlib.contextmanager
def as_if_on_hopper():
    """`jaxpaged.dispatch` and the engine see an H200 while this is open, so they pick (and
    lower) what they would there: Mosaic GPU kernels assume sm_90 off a GPU."""
    saved = jax.default_backend, dispatch.default_device
    jax.default_backend = lambda: "gpu"
    dispatch.default_device = lambda: dispatch.Device("gpu", "9.0", 132)
    try:
        yield
    finally:
        jax.default_backend, dispatch.default_device = saved


def compile_for_hopper(fn, *args, **static) -> str:
    """The optimized HLO text of `fn(*args, **static)` compiled for `hopper_device()`, where
    `fn` is jitted with `static` among its static arguments; `args` may be arrays or shapes."""
    sharding = SingleDeviceSharding(hopper_device())

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    with as_if_on_hopper():
        traced = fn.trace(*jax.tree.map(abstract, args), **static)
    return traced.lower().compile().as_text()


def _computations(text: str) -> tuple[dict[str, list[str]], str]:
    computations, name, entry = {}, None, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
        if header:
            name = header.group(2)
            computations[name] = []
            entry = name if header.group(1) else entry
        elif name and line.startswith("  ") and " = " in line:
            computations[name].append(line)
    return computations, entry


def _instruction(line: str) -> tuple[str, str, str, str]:
    """(name, shape, opcode, the text after the shape) of one HLO instruction line."""
    name, text = re.match(r"\s*(?:ROOT )?%(\S+) = (.*)$", line).groups()
    rest = _after_shape(text)
    opcode = re.match(r"\s*([\w-]+)\(", rest)
    return name, text[: len(text) - len(rest)].strip(), opcode.group(1) if opcode else "?", rest


def _after_shape(text: str) -> str:
    """`text` past the shape it starts with (a tuple shape's nested parentheses included)."""
    if not text.startswith("("):
        return text[text.find(" ") :]
    depth = 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            return text[i + 1 :]
    raise ValueError(f"unbalanced shape: {text[:80]}")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One launch: `where` is "entry", "body" or "condition" (of the outermost `while`), `kind`
    "custom call" (named by the Pallas kernel), "gemm", "dot as reduce" (a fusion that
    multiplies, transposes or reduces a weight-sized array: a dot that XLA rewrote, the
    issue's multiply + reduce of one row), "fusion" or the opcode."""

    where: str
    kind: str
    name: str


def _elements(shape: str) -> int:
    dims = re.match(r"\w+\[([\d,]*)\]", shape).group(1)
    return math.prod(int(d) for d in dims.split(",") if d)


def _rewrites_a_dot(lines: list[str], matrix_elements: int) -> bool:
    """Whether a fused computation multiplies, transposes or reduces `matrix_elements` or
    more: work on a weight matrix that only a dot should do."""
    sizes = {}
    for line in lines:
        name, shape, opcode, rest = _instruction(line)
        sizes[name] = 0 if shape.startswith("(") else _elements(shape)
        if opcode in ("multiply", "transpose") and sizes[name] >= matrix_elements:
            return True
        if opcode == "reduce":
            operand = re.match(r"\s*reduce\(%([^\s,)]+)", rest).group(1)
            if sizes.get(operand, 0) >= matrix_elements:
                return True
    return False


def kernels(text: str, matrix_elements: int = 2048 * 2048) -> list[Kernel]:
    """The launches of an optimized HLO module, through its loops and branches in order.
    `matrix_elements`: the smallest weight matrix (the default, `1b`'s o projection)."""
    computations, entry = _computations(text)
    found = []

    def walk(computation: str, where: str):
        for line in computations[computation]:
            name, _, opcode, rest = _instruction(line)
            if opcode == "while":  # a loop inside the block's loop counts as its body's
                for part in ("condition", "body"):
                    callee = re.search(part + r"=%([^\s,]+)", rest).group(1)
                    walk(callee, part if where == "entry" else where)
            elif opcode == "conditional":
                for branch in re.findall(r"%([^\s,{}]+)", rest.split("computations={")[-1]):
                    if branch in computations:
                        walk(branch, where)
            elif opcode == "call":
                walk(re.search(r"to_apply=%([^\s,]+)", rest).group(1), where)
            elif opcode == "custom-call":
                pallas = re.search(r'op_name="[^"]*/(\w+)/mpmd_map"', rest)
                found.append(Kernel(where, "custom call", pallas.group(1) if pallas else name))
            elif opcode == "fusion":
                fused = computations[re.search(r"calls=%([^\s,]+)", rest).group(1)]
                if "kind=kCustom" in rest and "gemm_fusion" in name:
                    kind = "gemm"
                elif _rewrites_a_dot(fused, matrix_elements):
                    kind = "dot as reduce"
                else:
                    kind = "fusion"
                found.append(Kernel(where, kind, name))
            elif opcode not in NO_LAUNCH:
                found.append(Kernel(where, opcode, name))

    walk(entry, "entry")
    return found


def decode_block_hlo(
    batch: int,
    *,
    layers: int,
    layer_kernel: bool | None,
    min_decode_rows: int | None,
    layer_form: str = "phases",
) -> tuple[str, int]:
    """The engine's greedy decode block for `1b` with `layers` layers at `batch` sequences,
    compiled for an H200: its HLO text and the decode step's rows (slots). `layer_kernel`,
    `layer_form`: `Decoder`'s; `min_decode_rows`: default the engine's choice on an H200."""
    config = dataclasses.replace(CONFIGS["1b"], num_layers=layers)
    model = Decoder(config, rngs=nnx.Rngs(0), layer_kernel=layer_kernel, layer_form=layer_form)
    saved = engine_module.MIN_DECODE_ROWS
    try:
        engine_config = roomy_engine_config(
            page_size=16, budget=2048, max_seqs=batch, max_len=4096, mixed_step_tokens=()
        )
        if min_decode_rows is None:  # what the engine picks on an H200, for Mosaic GPU
            with as_if_on_hopper():
                min_decode_rows = engine_module._fewest_decode_rows(
                    model, engine_config, "mosaic", None
                )
        engine_module.MIN_DECODE_ROWS = min_decode_rows
        # Built with the XLA implementation (nothing of it runs here); traced for Mosaic GPU.
        engine = Engine(model, engine_config, implementation="xla")
    finally:
        engine_module.MIN_DECODE_ROWS = saved
    fn, args, static = greedy_decode_block(engine)
    return compile_for_hopper(fn, *args, **static), engine.decode_rows


def greedy_decode_block(engine: Engine, implementation: str = "mosaic"):
    """The engine's jitted decode block with no rows, as `(fn, args, static)` for
    `fn.trace(*args, **static)`: its greedy form (`sampling_case` 0) over the engine's own
    parameters, pages and pool."""
    args = (engine.param_leaves, engine.kv_pages, engine.pool, engine._block_inputs([]))
    static = dict(
        num_steps=engine.config.decode_steps, implementation=implementation, sampling_case=0
    )
    return engine._block_fns[False], args, static


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=CONFIGS["1b"].num_layers)
    parser.add_argument(
        "--layer-kernel", action=argparse.BooleanOptionalAction, default=None,
        help="Decoder(layer_kernel=...); default the model's (None)",
    )  # fmt: skip
    parser.add_argument(
        "--layer-form", default="phases", choices=LAYER_FORMS, help="Decoder(layer_form=...)"
    )
    parser.add_argument("--min-decode-rows", type=int, default=None)
    parser.add_argument("--dump", type=Path, help="write the optimized HLO here")
    parser.add_argument("--json", action="store_true", help="the counts as one JSON line")
    args = parser.parse_args()
    text, rows = decode_block_hlo(
        args.batch,
        layers=args.layers,
        layer_kernel=args.layer_kernel,
        min_decode_rows=args.min_decode_rows,
        layer_form=args.layer_form,
    )
    if args.dump:
        args.dump.write_text(text)
    found = kernels(text)
    step = [k for k in found if k.where != "entry"]
    counts = collections.Counter(k.kind for k in step)
    named = collections.Counter(k.name for k in step if k.kind == "custom call")
    result = dict(
        batch=args.batch,
        rows=rows,
        layers=args.layers,
        kernels_per_step=len(step),
        by_kind=dict(counts),
        custom_calls=dict(named),
        outside_the_loop=sum(k.where == "entry" for k in found),
    )
    if args.json:
        print(json.dumps(result))
        return
    for kernel in found:
        if kernel.where != "entry" and kernel.kind not in ("gemm", "custom call"):
            print(f"{kernel.where:9s} {kernel.kind:12s} {kernel.name}")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
