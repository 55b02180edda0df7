"""The Placement page's layouts (console.qt.layouts_view) over made-up placement inputs: two desks
that hold a 3 GB model alone and one that does not, so copies, rings and the mix are all on offer.
Shared by tests/console/test_placement_layouts.py; a screenshot under Xvfb::

    xvfb-run -a env QT_QPA_PLATFORM=xcb python -m tests.console.layouts_screenshot --out layouts.png

(the whole Placement page, its plan solved over the same inputs).
"""

from __future__ import annotations

import argparse
from pathlib import Path

GB = 10**9
LAYERS = 16


def layouts_inputs(memory_gb: tuple[float, ...] = (8, 8, 2), total_gb: float = 3.0):
    """PlacementInputs of a ``total_gb`` model (16 layers, embedding and head 1/18 each) over PCs
    of ``memory_gb`` (desk-1, desk-2, ...), every one calibrated at 2 ms a layer."""
    from console.fleet_api.link_report import LinkReport
    from console.fleet_api.placement import PlacementInputs
    from engine.placement.types import DeviceProfile, Links, ModelProfile, PcInfo

    part = int(total_gb * GB / (LAYERS + 2))
    model = ModelProfile(layer_bytes=(part,) * LAYERS, embed_bytes=part, embed_ms=0.1, head_bytes=part, head_ms=2.0)
    ids = [f"pc{k + 1}" for k in range(len(memory_gb))]
    pcs = tuple(PcInfo(p, int(m * GB), True) for p, m in zip(ids, memory_gb, strict=True))
    devices = tuple(DeviceProfile(f"{p}/CPU", p, "CPU", 2.0, 4.0, int(m * GB)) for p, m in zip(ids, memory_gb,
                                                                                                  strict=True))
    return PlacementInputs(model, pcs, devices, LinkReport(Links(default_ms=1.0), {}, {}), (),
                           {p: f"desk-{k + 1}" for k, p in enumerate(ids)}, {})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--users", type=int, default=16)
    args = p.parse_args()
    import tempfile

    from PySide6.QtWidgets import QApplication

    from console.fleet.placement_inputs import solve_inputs
    from console.fleet_api.fleet_settings import FleetSettings
    from console.qt.placement_page import QtPlacementPage
    from console.qt.service_bridge import ServiceBridge
    from engine.placement.types import PlacementRequest

    app = QApplication.instance() or QApplication([])
    inputs = layouts_inputs()
    with tempfile.TemporaryDirectory() as state:
        bridge = ServiceBridge(FleetSettings(state_dir=Path(state)))
        page = QtPlacementPage(bridge)
        page.resize(1100, 820)
        page.show()
        bridge.session.set_plan(solve_inputs(inputs, PlacementRequest()), inputs)
        page.layouts.users.setValue(args.users)
        for _ in range(10):
            app.processEvents()
        page.grab().save(str(args.out))
        page.close()
    print(args.out)


if __name__ == "__main__":
    main()
