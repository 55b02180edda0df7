"""Deskfleet's headless runtime: shards, wire protocol, coordinator, placement.

Imports neither Qt nor torch, so a stage PC installs only openvino + numpy + small libraries.
"""

__version__ = "0.1.0"
