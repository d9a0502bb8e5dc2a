"""What XLA compiles for an H200, on a machine without one (`probes.deviceless`).

`kernels` reads the launches from an optimized HLO module's text; the first test holds it to a
module in the form XLA 0.11.2 prints it (lines from the engine's block, shortened). The compile
itself needs the CUDA PJRT plugin, which `make test` installs in an environment of its own
(`JAXPAGED_DEVICELESS_PYTHON`); the others run the probe there, in a subprocess.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probes.deviceless import Kernel, kernels


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda13") is not None
    except ModuleNotFoundError:  # no plugin at all
        return False


ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("JAXPAGED_DEVICELESS_PYTHON") or (
    sys.executable if _has_cuda_plugin() else None
)
needs_plugin = pytest.mark.skipif(
    PYTHON is None, reason="no CUDA PJRT plugin: `make test` sets JAXPAGED_DEVICELESS_PYTHON"
)

HLO = """HloModule jit_block, entry_computation_layout={(s32[])->s32[]}

%fused_add (param_0.114: s32[]) -> s32[] {
  %param_0.114 = s32[] parameter(0)
  %constant_117_1 = s32[] constant(1)
  ROOT %add.6.1 = s32[] add(%param_0.114, %constant_117_1)
}

%gemm_fusion_dot.1_computation (parameter_0: bf16[2048,1], parameter_1: bf16[2048,32000]) -> f32[1,32000] {
  %parameter_0 = bf16[2048,1]{1,0} parameter(0)
  %parameter_1 = bf16[2048,32000]{1,0} parameter(1)
  ROOT %dot.1 = f32[1,32000]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%fused_and (param_0.1: s32[]) -> pred[] {
  %param_0.1 = s32[] parameter(0)
  %constant_16 = s32[] constant(16)
  ROOT %compare.1 = pred[] compare(%param_0.1, %constant_16), direction=LT
}

%region_13.47 (arg_tuple.1: (s32[], bf16[2048,1], bf16[2048,32000])) -> (s32[], bf16[2048,1], bf16[2048,32000]) {
  %arg_tuple.1 = (s32[], bf16[2048,1]{1,0}, bf16[2048,32000]{1,0}) parameter(0)
  %get-tuple-element.1 = s32[] get-tuple-element(%arg_tuple.1), index=0
  %get-tuple-element.2 = bf16[2048,1]{1,0} get-tuple-element(%arg_tuple.1), index=1
  %get-tuple-element.3 = bf16[2048,32000]{1,0} get-tuple-element(%arg_tuple.1), index=2
  %mpmd_map.46 = (bf16[2048,1]{1,0}, s32[3,3]{1,0}) custom-call(%get-tuple-element.2), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(block)/while/body/layer_kernel/mpmd_map" scheduling_name="mpmd_map.46"}
  %get-tuple-element.4 = bf16[2048,1]{1,0} get-tuple-element(%mpmd_map.46), index=0
  %gemm_fusion_dot.1 = f32[1,32000]{1,0} fusion(%get-tuple-element.4, %get-tuple-element.3), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %loop_add_fusion = s32[] fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_add
  ROOT %tuple.5 = (s32[], bf16[2048,1]{1,0}, bf16[2048,32000]{1,0}) tuple(%loop_add_fusion, %get-tuple-element.4, %get-tuple-element.3)
}

%region_16.49 (arg_tuple.3: (s32[], bf16[2048,1], bf16[2048,32000])) -> pred[] {
  %arg_tuple.3 = (s32[], bf16[2048,1]{1,0}, bf16[2048,32000]{1,0}) parameter(0)
  %get-tuple-element.7 = s32[] get-tuple-element(%arg_tuple.3), index=0
  ROOT %loop_and_fusion = pred[] fusion(%get-tuple-element.7), kind=kLoop, calls=%fused_and
}

ENTRY %main.68 (tokens.1: s32[], x.1: bf16[2048,1], w.1: bf16[2048,32000]) -> s32[] {
  %tokens.1 = s32[] parameter(0)
  %x.1 = bf16[2048,1]{1,0} parameter(1)
  %w.1 = bf16[2048,32000]{1,0} parameter(2)
  %copy.51 = bf16[2048,1]{1,0} copy(%x.1)
  %tuple.0 = (s32[], bf16[2048,1]{1,0}, bf16[2048,32000]{1,0}) tuple(%tokens.1, %copy.51, %w.1)
  %while.12 = (s32[], bf16[2048,1]{1,0}, bf16[2048,32000]{1,0}) while(%tuple.0), condition=%region_16.49, body=%region_13.47
  ROOT %get-tuple-element.9 = s32[] get-tuple-element(%while.12), index=0
}
"""  # noqa: E501 (XLA's lines as it prints them)


def test_kernels_are_the_launches_reached_from_the_entry():
    """Each launch once, where it runs (the loop's condition and body apart), in order;
    the instructions inside fusions and the GEMM's computation are not launches."""
    assert kernels(HLO) == [
        Kernel("entry", "copy", "copy.51"),
        Kernel("condition", "fusion", "loop_and_fusion"),
        Kernel("body", "custom call", "layer_kernel"),
        Kernel("body", "gemm", "gemm_fusion_dot.1"),
        Kernel("body", "fusion", "loop_add_fusion"),
    ]


def _decode_block(*args: str) -> dict:
    """`probes.deviceless` on the engine's B=1 decode block of a 2-layer `1b`."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    run = subprocess.run(
        [PYTHON, "-m", "probes.deviceless", "--batch", "1", "--layers", "2", "--json", *args],
        cwd=ROOT,
        env=env | {"JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.splitlines()[-1])


@needs_plugin
def test_each_projection_of_a_decode_step_is_a_gemm_on_an_h200():
    """The issue's multiply + reduce (XLA rewrites a dot of one row): the engine's B=1 step
    through XLA's layers in two sequence slots compiles every projection as a GEMM, and in one
    slot (the control that shows the check can fail) XLA rewrites all of the layers' (qkv, o,
    gate/up, down), the logits staying a GEMM."""
    two = _decode_block("--no-layer-kernel")
    assert two["rows"] == 2 and "dot as reduce" not in two["by_kind"], two
    assert two["by_kind"]["gemm"] == 4 * 2 + 1, two
    one = _decode_block("--no-layer-kernel", "--min-decode-rows", "1")
    assert one["rows"] == 1 and one["by_kind"]["gemm"] == 1, one
    assert one["by_kind"]["dot as reduce"] >= 4 * 2, one


# The custom calls of a 2-layer step through the layer path (its default form, the phases):
# the first layer's norm and qkv, per layer the decode kernel (its Pallas name is `body`) and
# the layer's kernels after it. The persistent form's lowering: `tests/test_layer_path.py`.
LAYER_PATH_CALLS = {
    "norm_qkv_kernel": 1,
    "body": 2,
    "layer_o_kernel": 2,
    "layer_gate_up_kernel": 2,
    "layer_down_kernel": 2,
    "layer_qkv_kernel": 1,  # the last layer's: its final norm's `add_rms_norm`
    "add_rms_norm": 1,
}


@needs_plugin
def test_layer_path_decode_step_on_an_h200_in_one_slot():
    """The engine's B=1 step through the layer path, as it runs on an H200: one sequence slot
    (`LAYER_PATH_MIN_DECODE_ROWS`), the first layer's norm and qkv kernel, per layer the
    decode kernel and its phases' kernels, the logits as the one GEMM (not rewritten at one
    row), and no more than 14 other kernels (the step's bookkeeping and sampling: 14 with two
    layers or sixteen, where XLA's layers add 4 GEMMs, 2 custom calls and a fusion a
    layer)."""
    step = _decode_block("--layer-form", "phases")
    assert step["rows"] == 1, step
    assert step["custom_calls"] == LAYER_PATH_CALLS, step
    assert step["by_kind"]["gemm"] == 1 and "dot as reduce" not in step["by_kind"], step
    assert step["by_kind"]["fusion"] <= 14, step
