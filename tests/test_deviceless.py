"""`probes.deviceless.kernels`: the launches of an optimized HLO module, read from its text.
The compile for an H200 itself needs the CUDA PJRT plugin, which the tests do not install;
this is a module in the form XLA 0.11.2 prints it (lines from the engine's block, shortened)."""

from probes.deviceless import Kernel, kernels

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
