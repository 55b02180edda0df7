"""Exported stages on this PC: the manifest, the OpenVINO stage runner, KV visibility, prefix captures, step paths."""
