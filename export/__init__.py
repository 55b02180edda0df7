"""Checkpoint (safetensors directory or GGUF) -> per-stage stateful OpenVINO shards + manifest.

The CPU/GPU path builds each stage's graph straight from the checkpoint's tensors (export/builder,
export/weights) with openvino + numpy + safetensors + gguf: no torch. Only the static NPU target
(export/npu_export.py, the export-npu extra) still traces with torch. Never Qt.
"""
