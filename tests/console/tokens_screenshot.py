"""The Join tokens dialog driven as an admin does, against a real fleet service and a real agent:
issue a 40-use auto-approving token with a label, an agent joins with it, refuse a never-expiring
auto-approving one in the form, revoke the service's single-use token, copy the new one. Then a
screenshot. Shared by tests/console/test_tokens_dialog.py (offscreen, in-process) and its Xvfb run
(a subprocess)::

    xvfb-run -a env QT_QPA_PLATFORM=xcb python -m tests.console.tokens_screenshot --out DIR --work TMP
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

LABEL = "floor 3 roll-out"
Wait = Callable[[Callable[[], bool], float, str], None]


def drive_tokens_dialog(work: Path, wait: Wait, out: Path | None = None) -> dict:
    """Run the story (see the module docstring); what the test checks, and the PNG when ``out``."""
    from PySide6.QtGui import QGuiApplication

    from console.qt.service_bridge import ServiceBridge
    from console.qt.tokens_dialog import QtTokensDialog
    from tests.console.console_app_helpers import console_settings, fleet_service, local_agents

    name = f"floor3-pc-{uuid.uuid4().hex[:4]}"  # mDNS on loopback is shared with other runs
    with fleet_service(work / "service") as running, local_agents(work / "agents", (name,)) as (loop, agents):
        bridge = ServiceBridge(console_settings(running.state_dir))
        bridge.start()
        dialog = None
        try:
            wait(lambda: bridge.running, 60, "the console to attach")
            dialog = QtTokensDialog(bridge)
            dialog.show()
            # the service issued one at its start, the console one as it attached: single-use, both
            wait(lambda: len(dialog.rows) >= 1, 20, "the service's tokens listed")
            before = len(dialog.rows)
            first_id = dialog.rows[-1].token_id

            dialog.uses.setValue(40)
            dialog.expiry.setCurrentIndex([dialog.expiry.itemText(i) for i in range(dialog.expiry.count())]
                                          .index("7 days"))
            dialog.auto_approve.setChecked(True)
            dialog.label_edit.setText(LABEL)
            dialog.issue_button.click()
            wait(lambda: dialog.token_edit.text().startswith("DFJ1-") and len(dialog.rows) == before + 1, 20,
                 "the new token and its row")
            token = dialog.token_edit.text()
            loop.run(agents[name].async_join(running.service.host.enrollment, token), 60, "the agent joining")
            wait(lambda: any(name in r.cells[-1] for r in dialog.rows), 20, "the admitted PC in the list")

            dialog.expiry.setCurrentIndex(dialog.expiry.count() - 1)  # "never", with auto-approve still ticked
            dialog.issue_button.click()
            refused = dialog.status.text()
            dialog.expiry.setCurrentIndex(0)

            dialog.confirm_revoke = lambda row: True  # the question box, answered Yes
            dialog.table.selectRow(next(i for i, r in enumerate(dialog.rows) if r.token_id == first_id))
            dialog.revoke_button.click()
            wait(lambda: any(r.token_id == first_id and r.cells[7] == "revoked" for r in dialog.rows), 20,
                 "the revoked token's state")
            dialog.copy_button.click()
            copied = QGuiApplication.clipboard().text()
            dialog.table.clearSelection()
            result = {"rows": dialog.rows, "token": token, "refused": refused, "copied": copied, "first_id": first_id,
                      "name": name, "revoke_enabled": dialog.revoke_button.isEnabled(),
                      "node_id": agents[name].status().node_id}
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                dialog.resize(1100, 560)
                settle_until = []
                wait(lambda: settle_until.append(1) or len(settle_until) > 15, 5, "the dialog to paint")
                path = out / "console-join-tokens.png"
                if not dialog.grab().save(str(path)):
                    raise OSError(f"could not write {path}")
                result["png"] = path
            return result
        finally:
            if dialog is not None:
                dialog.close()
                dialog.deleteLater()
            bridge.close()


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    from tests.support.xvfb import qt_wait

    p = argparse.ArgumentParser(description="screenshot of the console's Join tokens dialog")
    p.add_argument("--out", type=Path, required=True, help="where console-join-tokens.png goes")
    p.add_argument("--work", type=Path, required=True, help="a scratch folder for the service and the agent")
    args = p.parse_args(argv)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    result = drive_tokens_dialog(args.work, lambda c, t, w: qt_wait(app, c, t, w), args.out)
    print(json.dumps(to_json(result)))
    return 0


def to_json(result: dict) -> dict:
    """``drive_tokens_dialog``'s result as JSON (the rows as their cells), for the test to read back."""
    rows = [{"token_id": r.token_id, "cells": list(r.cells), "active": r.active} for r in result["rows"]]
    return {**result, "rows": rows, "png": str(result.get("png", ""))}


if __name__ == "__main__":
    sys.exit(main())
