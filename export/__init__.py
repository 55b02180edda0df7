"""Checkpoint -> per-stage stateful OpenVINO shards + manifest. Uses torch; never Qt."""
