"""NPU-target exports of the tiny models, built once per test session and shared by test modules."""

from __future__ import annotations

from pathlib import Path

_BUILT: dict[tuple, Path] = {}


def npu_export(tmp_path_factory, checkpoint: Path, *, stages: int = 1, context: int = 64, slots: int = 1,
               prefill_chunk: int | None = None, weights: str = "fp32", group_size: int = 16) -> Path:
    """``checkpoint`` exported with ``--target npu``, cached for the session under its base temp dir
    (so every test module shares one export per setting)."""
    from export.exporter import ExportOptions, export_model

    key = (str(checkpoint), stages, context, slots, prefill_chunk, weights, group_size)
    if key not in _BUILT:
        root = tmp_path_factory.getbasetemp() / "npu-exports"
        out = root / "-".join(str(k).replace("/", "_") for k in key[1:]) / Path(checkpoint).name
        options = ExportOptions(weights=weights, group_size=group_size, target="npu", context=context, slots=slots,
                                prefill_chunk=prefill_chunk)
        export_model(checkpoint, out, stages=stages, options=options)
        _BUILT[key] = out
    return _BUILT[key]
