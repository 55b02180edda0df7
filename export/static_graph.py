"""Static, stateless stage graphs for the NPU: pinned shapes, explicit KV ports, a 4-D mask input.

The NPU compiler accepts neither dynamic dimensions nor ReadValue/Assign state, so an NPU shard
is a pure function of fixed-shape tensors (paper §8.5)::

    x               [1, S]  int64 ids (stage 0) or [1, S, H] float32 hidden states
    attention_mask  [1, W + S] int64        (unpacked graphs: one mask row shared by all S rows)
    attention_bias  [1, 1, S, W + S] float32 (packed graphs: one row per query row, 0 or -big)
    position_ids    [1, S] int64            true absolute positions, one per row
    past_key_{i}    [1, KV, W, D] float32   the host's KV ring for layer i, fed as it is
    -> hidden_states_out [1, S, H] or logits [1, S, V], new_key_{i}/new_value_{i} [1, KV, S, D]

W is the past window and S the rows of the graph: 1 for decode, C for a prefill chunk, the slot
count for the packed graph. The packed variant is made by a graph edit on the static IR (no
re-trace): the one node that turns the 2-D mask into the additive [1, 1, S, W + S] bias feeding
every attention block is replaced by a Parameter, so the host can write a different mask row
for every query row (paper §8.6).
"""

from __future__ import annotations

from collections.abc import Mapping

import openvino as ov
import openvino.opset13 as ops

from engine.errors import DeskfleetError

MASK_2D = "attention_mask"
MASK_4D = "attention_bias"
_SDPA = "ScaledDotProductAttention"
_SDPA_MASK_PORT = 3
_SHAPE_ONLY = frozenset({"Reshape", "Broadcast", "Unsqueeze", "Squeeze", "Tile"})


class StaticShapeError(DeskfleetError):
    """A graph meant for the NPU still has a dynamic dimension (after reshape or compression)."""


class MaskEditError(DeskfleetError):
    """The packed-mask graph edit cannot find the single node that builds the attention mask."""


def static_shapes(inputs: list[str], *, rows: int, window: int, hidden: int, kv_heads: int,
                  head_dim: int, has_embedding: bool) -> dict[str, ov.PartialShape]:
    """The pinned shape of every input of a stateless stage graph with ``rows`` query rows."""
    shapes: dict[str, ov.PartialShape] = {}
    for name in inputs:
        if name == "input_ids":
            dims = [1, rows]
        elif name == "hidden_states":
            dims = [1, rows, hidden]
        elif name == MASK_2D:
            dims = [1, window + rows]
        elif name == "position_ids":
            dims = [1, rows]
        elif name.startswith(("past_key_", "past_value_")):
            dims = [1, kv_heads, window, head_dim]
        else:
            raise StaticShapeError(f"input {name!r} has no static shape rule; the stage graph is "
                                   "not a stateless stage (was it made stateful?)")
        shapes[name] = ov.PartialShape(dims)
    del has_embedding  # both first inputs are covered by name; kept for call-site clarity
    return shapes


def make_static(model: ov.Model, shapes: Mapping[str, ov.PartialShape]) -> ov.Model:
    """Pin every input to ``shapes`` (in place) and check that nothing dynamic is left.

    Shape arithmetic (ShapeOf chains) is folded into constants afterwards: with every shape known
    it computes nothing, and left in place it would tie the mask's consumers to the 2-D mask input
    that the packed edit removes.
    """
    from openvino.passes import ConstantFolding, Manager

    model.reshape(dict(shapes))
    manager = Manager()
    manager.register_pass(ConstantFolding())
    manager.run_passes(model)
    check_static(model, "after reshape")
    return model


def dynamic_outputs(model: ov.Model, limit: int = 5) -> list[str]:
    """Up to ``limit`` descriptions of node outputs whose shape or rank is not fully static."""
    found: list[str] = []
    for op in model.get_ordered_ops():
        for i in range(op.get_output_size()):
            shape = op.get_output_partial_shape(i)
            if not shape.is_static:
                found.append(f"{op.get_type_name()} {op.get_friendly_name()!r} output {i} {shape}")
                if len(found) >= limit:
                    return found
    return found


def check_static(model: ov.Model, when: str) -> None:
    """Raise :class:`StaticShapeError` naming the first dynamic outputs of ``model``.

    Checked on every node, not only the ports: the paper found INT4 decompression subgraphs that
    reintroduce a dynamic dimension which CPU and GPU tolerate and the NPU refuses at load time,
    so the exporter runs this again after weight compression.
    """
    bad = dynamic_outputs(model)
    if bad:
        raise StaticShapeError(
            f"the NPU graph has dynamic dimensions {when}: " + "; ".join(bad)
            + ". The NPU compiles only fully static graphs; this is an exporter bug for this "
            "architecture or weight format - please report it (try --weights fp16 meanwhile)"
        )


def check_stateless(model: ov.Model) -> None:
    """An NPU graph must carry no ReadValue/Assign state: its KV lives on the host."""
    if model.get_sinks() or any(op.get_type_name() == "ReadValue" for op in model.get_ops()):
        raise StaticShapeError("the NPU graph holds state variables (ReadValue/Assign); the NPU "
                               "cannot compile them - export with --target npu, not a stateful shard")


def _query_rows(model: ov.Model) -> int:
    """S, from the static ``position_ids`` [1, S] input."""
    for p in model.inputs:
        if "position_ids" in p.get_names() and p.get_partial_shape().is_static:
            return p.get_partial_shape()[1].get_length()
    raise MaskEditError("the graph has no static position_ids [1, S] input; make it static before packing")


def _is_mask_shape(shape: ov.PartialShape, rows: int) -> bool:
    return (shape.is_static and shape.rank.get_length() == 4 and shape[0].get_length() == 1
            and shape[1].get_length() == 1 and shape[2].get_length() == rows)


def replace_mask_with_input(model: ov.Model) -> ov.Model:
    """Replace the shared additive-mask node with a ``attention_bias`` [1, 1, S, T] f32 input.

    Works on a static stage graph, freshly converted or read back from IR: every attention block
    takes its mask from input 3 of a ScaledDotProductAttention op, and in a Deskfleet stage all of
    them read one node (built once from the 2-D ``attention_mask``, its rows then repeated per
    query group by shape-only ops). That node's output is replaced by a Parameter of the same
    type and shape, and the 2-D mask input, now unused, is removed. In place; returns ``model``.
    """
    sdpa = [op for op in model.get_ordered_ops() if op.get_type_name() == _SDPA]
    if not sdpa:
        raise MaskEditError("the graph has no ScaledDotProductAttention op; only Deskfleet stage "
                            "graphs (which keep attention fused) can be packed")
    sources = {(op.input_value(_SDPA_MASK_PORT).get_node().get_friendly_name(),
                op.input_value(_SDPA_MASK_PORT).get_index())
               for op in sdpa if op.get_input_size() > _SDPA_MASK_PORT}
    if len(sources) != 1 or any(op.get_input_size() <= _SDPA_MASK_PORT for op in sdpa):
        raise MaskEditError(f"expected one mask node shared by all {len(sdpa)} attention ops, found "
                            f"{len(sources)}; this stage graph was not built by the Deskfleet exporter")
    source = sdpa[0].input_value(_SDPA_MASK_PORT)
    # Grouped-query graphs repeat the mask rows per query group after building it: look through
    # those shape-only ops for the [1, 1, S, T] node itself.
    rows = _query_rows(model)
    while not _is_mask_shape(source.get_partial_shape(), rows) and source.get_node().get_type_name() in _SHAPE_ONLY:
        source = source.get_node().input_value(0)
    shape = source.get_partial_shape()
    if not _is_mask_shape(shape, rows):
        raise MaskEditError(f"the shared mask node has shape {shape}, not a static [1, 1, {rows}, T]; "
                            "make the graph static before packing it")
    bias = ops.parameter(shape, source.get_element_type(), name=MASK_4D)
    source.replace(bias.output(0))
    bias.output(0).get_tensor().set_names({MASK_4D})  # replace() moved the old node's names here
    old = [p for p in model.get_parameters() if MASK_2D in p.output(0).get_names()]
    for p in old:
        model.remove_parameter(p)
    model.add_parameters([bias])
    still = [op for op in model.get_ordered_ops() for inp in op.inputs()
             if MASK_2D in inp.get_source_output().get_names()]
    if still:
        raise MaskEditError("the 2-D attention_mask still feeds the graph after the edit; the mask "
                            "is built in more than one place, so the graph cannot be packed")
    model.validate_nodes_and_infer_types()
    return model
