"""Incremental detokenisation: generated ids in, text that is safe to send out, stop strings cut.

Decoding the whole answer again on every token costs O(n) per token, O(n²) per answer. A
:class:`TextStream` decodes a short window instead: the ids since the last point where the text
was whole (no character cut between tokens) plus the window before it as context. The context
matters because a tokenizer's decoder can depend on what precedes a token (SentencePiece drops the
leading space of the first piece, byte-level BPE needs every byte of a character); the new text
is the window's text less its context's text. The window restarts at every whole point, so each
token costs a decode of a few ids (a character cut across k tokens keeps k ids in it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.generation.markers import partial_marker_len

_CUT = "\ufffd"  # what a decoder writes for a UTF-8 character cut between tokens
# A UTF-8 character has at most 4 bytes, so a cut still open after this many new ids is no cut
# but bytes that never make a character: they are sent as U+FFFD and the window moves on.
_MAX_CUT_IDS = 8


class TextStream:
    """Turn generated ids into safe-to-send text deltas, and stop at the first stop string.

    Holds back a trailing U+FFFD (a multi-byte character cut between tokens) and any tail that
    could be the start of a stop string, so nothing sent ever has to be taken back. Work per
    token is constant: a decode of the window (above) and a search of the held tail, which is
    shorter than the longest stop string.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._context = 0  # ids[_context:_window] are the context, ids[_window:] the new ids
        self._window = 0
        self._context_len = 0  # characters the context decodes to
        self._taken = 0  # characters of the window's text (after its context) already taken
        self._decoded = 0  # characters the ids so far decode to, less a cut character at the end
        self._held = ""  # decoded text not sent yet: the tail that may start a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found; the caller should close the token stream
        self.offsets: list[int] = []  # where each pushed token's text starts in the decoded text

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text that is now safe to send (may be empty)."""
        self.offsets.append(self._decoded)
        self._ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """Return the held-back text once generation has ended."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        self._held += self._take_new_text(final)
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            end = min(hits)
        elif final:
            end = len(self._held)
        else:
            end = len(self._held) - partial_marker_len(self._held, self._stop)
        delta, self._held = self._held[:end], self._held[end:]
        self.text += delta
        return delta

    def _take_new_text(self, final: bool) -> str:
        """The text the window adds since the last call (all of it at the end, cut or not)."""
        window = self._decode(self._ids[self._context:])
        cut = window.endswith(_CUT) and len(self._ids) - self._window < _MAX_CUT_IDS
        whole = window.rstrip(_CUT) if cut and not final else window
        new = whole[self._context_len + self._taken:]
        self._taken += len(new)
        self._decoded += len(new)
        if not cut:  # a whole point: the new ids become the next context
            self._context, self._window = self._window, len(self._ids)
            self._context_len = len(self._decode(self._ids[self._context:self._window]))
            self._taken = 0
        return new
