"""Torch-free stage builder: each stage's OpenVINO graph written op by op from checkpoint tensors.

``families`` parses the config, ``rope`` computes rotary tables, ``ops`` holds the fusable
blocks, ``stage_graph`` assembles one stage, ``export`` writes shards and the manifest.
"""
