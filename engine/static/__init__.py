"""The static-graph (NPU-target) path: host KV ring, packed slots, static stages, their worker and generator."""
