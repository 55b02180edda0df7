"""Deskfleet's benchmarks: harness, not product (run ``python -m tests.benchmarks --help``; README.md)."""
