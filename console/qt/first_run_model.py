"""What the console's first-run view says and shows, decided without Qt: the fleet's id, how PCs
join (only the token: they find this console on the network), and the token as a QR code.

The QR code is encoded by ``segno`` (a registry package, pure Python); where it is not installed
the view shows the token without a code and says so. :mod:`console.qt.first_run_view` paints it.
"""

from __future__ import annotations

from dataclasses import dataclass

QUIET_ZONE = 4  # modules of white around a QR code, as the standard asks

NO_QR = "(Install the Python package segno to show this token as a QR code.)"


@dataclass(frozen=True)
class FirstRunText:
    headline: str
    fleet: str
    steps: str
    address: str


def first_run_text(fleet_id: str, enrollment: str, ttl_hours: float = 24) -> FirstRunText:
    """The words around the token: what the fleet is, and what to do on each PC."""
    return FirstRunText(
        headline="Your fleet is ready",
        fleet=f"This console created fleet {fleet_id[:16]}: its own certificate authority, kept in this "
              "console's folder. Only PCs you let in can join it.",
        steps=("On each PC: install the Deskfleet agent and start it. It asks for one thing, a join token: "
               "copy the token below (or scan the code) and paste it there. The PC finds this console on "
               f"the network by itself. Each token lets one PC in, once, within {ttl_hours:g} hours; press "
               "New token for the next PC. Joined PCs then wait for your approval on the Fleet page. "
               "They work only while nobody uses them, and pause the moment someone does."),
        address=f"A PC on another network also needs this console's address: {enrollment}")


def qr_matrix(text: str) -> tuple[tuple[bool, ...], ...] | None:
    """The QR code of ``text`` as rows of dark (True) modules, without the quiet zone; None when
    segno is not installed."""
    try:
        import segno
    except ImportError:
        return None
    code = segno.make(text, error="m", micro=False)
    return tuple(tuple(bool(v) for v in row) for row in code.matrix)
