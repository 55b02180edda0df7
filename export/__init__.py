"""Checkpoint (safetensors directory or GGUF) -> per-stage OpenVINO shards + manifest.

Both targets build each stage's graph straight from the checkpoint's tensors (export/builder,
export/weights) with openvino + numpy + safetensors + gguf: stateful graphs for CPU/GPU, static
stateless ones for the NPU (export/static_export.py). No torch, no transformers, never Qt.
"""
