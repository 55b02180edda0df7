"""OpenVINO graph surgery on a converted stage: stateful KV cache and the beam_idx Gather.

After conversion a stage has explicit ``past_key_{i}`` inputs and ``present_key_{i}`` outputs.
:func:`make_stateful` turns each pair into a ReadValue/Assign variable, so the cache lives on
the device between calls. Each ReadValue gets a zero-length initialiser of shape
[1, KV, 0, D]: the CPU plugin can reject an init-less ReadValue, and an empty state after
``reset_state()`` could otherwise come back with a zero batch dimension.

With ``beam_idx=True`` every state read goes through ``Gather(ReadValue, beam_idx, axis=0)``
fed by a new ``beam_idx`` [-1] i32 Parameter. At run time beam_idx is always [0] (an identity
reorder), but the pattern is what makes the CPU and GPU plugins fuse attention with the cache
(one ScaledDotProductAttention per layer reading the state directly); without it decode is
30-55 % slower on the CPU here.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino.op import assign as Assign
from openvino.op import read_value as ReadValue
from openvino.op.util import Variable, VariableInfo

BEAM_IDX = "beam_idx"


def convert_torch(module, example_input: tuple) -> ov.Model:
    """Trace ``module`` and convert it with OpenVINO's PyTorch frontend.

    This is what ``ov.convert_model`` does for a module, minus its input preprocessing pass
    (seconds per stage, for nothing here) and minus its usage telemetry: an export must not try
    to send anything off the machine.
    """
    from openvino._offline_transformations import apply_moc_transformations
    from openvino.frontend import FrontEndManager
    from openvino.frontend.pytorch.ts_decoder import TorchScriptPythonDecoder
    from openvino.tools.ovc.moc_frontend.offline_transformations import apply_fused_names_cleanup

    decoder = TorchScriptPythonDecoder(module, example_input=example_input, shared_memory=True)
    frontend = FrontEndManager().load_by_framework("pytorch")
    model = frontend.convert(frontend.load(decoder))
    apply_moc_transformations(model, cf=False, smart_reshape=True)
    apply_fused_names_cleanup(model)
    return model


def _io_name(port) -> str:
    return port.get_any_name()


def make_stateful(model: ov.Model, layers: list[int], kv_heads: int, head_dim: int, beam_idx: bool) -> ov.Model:
    """Replace past/present KV inputs/outputs with ReadValue/Assign pairs (in place)."""
    params = {_io_name(p.output(0)): p for p in model.get_parameters()}
    results = {_io_name(r.output(0)): r for r in model.get_results()}
    beam = None
    if beam_idx:
        beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name=BEAM_IDX)
        beam.output(0).get_tensor().set_names({BEAM_IDX})
    sinks = []
    for i in layers:
        for kind in ("key", "value"):
            param = params[f"past_{kind}_{i}"]
            result = results[f"present_{kind}_{i}"]
            info = VariableInfo()
            info.variable_id = f"past_{kind}_{i}"
            info.data_shape = ov.PartialShape([-1, kv_heads, -1, head_dim])
            info.data_type = param.get_element_type()
            variable = Variable(info)
            init = ops.constant(np.zeros((1, kv_heads, 0, head_dim), dtype=np.float32))
            if param.get_element_type() != ov.Type.f32:
                init = ops.convert(init, param.get_element_type())
            read = ReadValue(init.output(0), variable)
            state = ops.gather(read, beam, ops.constant(0, dtype=np.int64)) if beam is not None else read
            param.output(0).replace(state.output(0))
            new_value = result.input_value(0)
            # Assign takes a node; the present K/V comes from the single-output Concat.
            assign = Assign(new_value.get_node(), variable)
            model.remove_result(result)
            model.remove_parameter(param)
            sinks.append(assign)
    model.add_sinks(sinks)
    if beam is not None:
        model.add_parameters([beam])
    model.validate_nodes_and_infer_types()
    return model


def set_io_names(model: ov.Model, inputs: list[str], outputs: list[str]) -> None:
    """Give every input and output a single stable tensor name (conversion names are unstable)."""
    for port, name in zip(model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})


def set_runtime_options(model: ov.Model, options: dict[str, str]) -> None:
    """Write plugin properties into the IR so that a plain ``compile_model`` applies them."""
    for key, value in options.items():
        model.set_rt_info(value, ["runtime_options", key])
