"""The fleet service's join tokens: issue / list / revoke for the admin API, and auto-approval.

:class:`TokenDesk` is what the admin routes call (``/admin/v1/tokens``): it parses the admin's
options (uses, ttl_s — ``null`` for a token that never expires —, auto_approve, label), issues
through the fleet's :class:`~engine.trust.join_token.TokenBook` and publishes the new listing as
a ``tokens`` event.

Auto-approval: a PC admitted by a token marked ``auto_approve`` is approved as soon as the
service has verified it (its registration at the hub, or a probe over mutual TLS, made its record
``verified``): not at the join itself, where the service knows its node id but not yet where its
control API listens. Pending PCs are remembered in the book (which token admitted which PC), so a
service restart between the join and the first registration still approves them; a token revoked
in between approves nobody more. Every approval — by the admin or by a token — is a line in the
enrolment audit naming the token that admitted the PC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from console.fleet_api.admin_shapes import field
from console.fleet_api.agent_record import AgentRecord, Membership
from console.fleet_api.errors import FleetServiceError
from console.fleet_api.feed import EventKind
from engine.control.join_audit import JoinAudit
from engine.errors import DeskfleetError
from engine.trust.join_token import DEFAULT_TTL_S, TokenBook, TokenInfo

log = logging.getLogger("deskfleet.fleet.tokens")

Publish = Callable[[EventKind, dict[str, Any]], None]
EVENT_ADMITTED = 20  # admissions per token in a ``tokens`` event
PUBLISH_EVERY_S = 1.0


class TokenNotFoundError(FleetServiceError):
    """An admin named a join-token id the service's book does not hold (never issued, or pruned)."""


def issue_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The admin's ``POST /tokens`` body as TokenBook.issue_token's keywords (ShapeError if malformed)."""
    ttl_s = None if "ttl_s" in body and body["ttl_s"] is None else field(body, "ttl_s", float, default=DEFAULT_TTL_S)
    return {"uses": field(body, "uses", int, default=1), "ttl_s": ttl_s,
            "auto_approve": field(body, "auto_approve", bool, default=False),
            "label": field(body, "label", str, default="")}


class TokenDesk:
    """Join tokens as the service offers them (see the module docstring). Runs on the service's loop."""

    def __init__(self, book: TokenBook, audit: JoinAudit | None, publish: Publish) -> None:
        self.book = book
        self.audit = audit
        self._publish = publish
        self._pending: set[str] = set()  # node ids admitted by an auto-approving token, not yet approved
        self._approve: Callable[[str], AgentRecord] | None = None
        self._scheduled = False
        self._publish_due = False
        self._ready: set[str] = set()  # pending PCs seen verified: approved on the loop's next turn

    # ---- admin routes --------------------------------------------------------------------------

    def issue(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``{"token", "expires_at", "token_info"}``: the text is in this answer only."""
        issued = self.book.issue_token(**issue_options(body))
        info = issued.info
        log.info("issued join token %s (%s): %d use(s), %s%s", info.token_id, info.label or "no label", info.uses,
                 "no expiry" if info.expires_at is None else f"expires at {info.expires_at:.0f}",
                 ", auto-approving" if info.auto_approve else "")
        self._publish_listing()
        return {"token": issued.text, "expires_at": info.expires_at, "token_info": info.to_json()}

    def listing(self) -> dict[str, Any]:
        return {"tokens": [t.to_json() for t in self.book.tokens()]}

    def revoke(self, token_id: str) -> dict[str, Any]:
        if not any(t.token_id == token_id for t in self.book.tokens()):
            raise TokenNotFoundError(f"no join token {token_id!r} in this service's book (never issued, or "
                                     "dead for over a week); list them with 'deskfleet fleet tokens list'")
        info = self.book.revoke(token_id)
        log.warning("revoked join token %s (%s): it admits no PC from now on", token_id, info.label or "no label")
        self._publish_listing()
        return {"token": info.to_json()}

    def _publish_listing(self) -> None:
        """The ``tokens`` event: each token with its newest EVENT_ADMITTED admissions only (a roll-out's
        token admits hundreds; ``GET /tokens`` lists them all)."""
        self._publish_due = False
        with contextlib.suppress(DeskfleetError):
            tokens = [t.to_json(admitted_limit=EVENT_ADMITTED) for t in self.book.tokens()]
            self._publish(EventKind.TOKENS, {"tokens": tokens})

    def _publish_soon(self) -> None:
        """At most one ``tokens`` event per PUBLISH_EVERY_S while PCs join (not one full listing per join)."""
        if self._publish_due:
            return
        self._publish_due = True
        try:
            asyncio.get_running_loop().call_later(PUBLISH_EVERY_S, self._publish_listing)
        except RuntimeError:  # no loop (a unit test)
            self._publish_listing()

    # ---- auto-approval and the audit -----------------------------------------------------------

    def attach(self, approve: Callable[[str], AgentRecord], records: tuple[AgentRecord, ...]) -> None:
        """Approve through ``approve`` (``FleetModel.approve``) from now on; PCs an auto-approving token
        admitted that are not approved yet are pending again (a restart between join and registration)."""
        self._approve = approve
        approved = {r.key for r in records if r.approved}
        for info in self.book.tokens():
            if info.auto_approve and info.state != "revoked":
                self._pending.update(a.node_id for a in info.admitted if a.node_id not in approved)
        self.on_records(records)

    def on_join(self, node_id: str, name: str) -> None:
        """A PC was admitted (``FleetHost.subscribe_joins``); pending if its token auto-approves."""
        info = self.book.admitted_by(node_id)
        if info is not None and info.auto_approve:
            self._pending.add(node_id)
        self._publish_soon()  # its used count changed

    def on_records(self, records: tuple[AgentRecord, ...]) -> None:
        """Approve the pending PCs the service has verified; later on the loop, not inside the
        records listener (approving changes the records the other listeners are being given)."""
        if not self._pending:
            return
        ready = {r.key for r in records if r.key in self._pending and _approvable(r)}
        if not ready or ready <= self._ready:
            return
        self._ready |= ready
        if self._scheduled:
            return
        self._scheduled = True
        try:
            asyncio.get_running_loop().call_soon(self._approve_ready)
        except RuntimeError:  # no loop (a unit test): approve now
            self._approve_ready()

    def _approve_ready(self) -> None:
        self._scheduled = False
        ready, self._ready = self._ready, set()
        by_node = {a.node_id: info for info in self.book.tokens() for a in info.admitted}  # one read of the book
        for node_id in sorted(ready & self._pending):
            info = by_node.get(node_id)
            if info is None or not info.auto_approve or info.state == "revoked":
                self._pending.discard(node_id)  # revoked meanwhile: the admin approves by hand
                continue
            if self._approve is None:
                return
            try:
                record = self._approve(node_id)
            except DeskfleetError as exc:  # not verified yet, or gone: the next records try again
                log.debug("auto-approval of %s waits: %s", node_id[:16], exc)
                continue
            self._pending.discard(node_id)
            if record.approved:
                self._write("auto_approved", node_id, record.name, info)

    def note_approved(self, record: AgentRecord) -> None:
        """The admin approved ``record``: the audit line, with the token that admitted it."""
        self._pending.discard(record.key)
        self._write("approved", record.key, record.name, self.book.admitted_by(record.key))

    def note_removed(self, node_id: str, name: str) -> None:
        self._pending.discard(node_id)
        self._write("removed", node_id, name, self.book.admitted_by(node_id))

    def _write(self, event: str, node_id: str, name: str, info: TokenInfo | None) -> None:
        if not name and info is not None:  # a PC known from its hub registration only: the name it joined with
            name = next((a.name for a in info.admitted if a.node_id == node_id), "")
        if self.audit is not None:
            self.audit.write(event, node_id=node_id, name=name, token_id=info.token_id if info else None,
                             token_label=info.label if info else None)


def _approvable(record: AgentRecord) -> bool:
    return not record.approved and record.verified and record.membership is Membership.MEMBER


__all__ = ["TokenDesk", "TokenNotFoundError", "issue_options"]
