"""Torch-free weight access and lowering for the stage builder.

``checkpoint`` reads tensors lazily (HF safetensors directories, GGUF files); ``rtn`` quantises
them in numpy exactly as NNCF's RTN does; ``stage_weights`` turns them into the OpenVINO
decompression subgraphs the CPU/GPU plugins run compressed; ``weight_file`` keeps each stage's
constants on a memory-mapped file instead of in anonymous memory.
"""
