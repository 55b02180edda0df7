"""The chat's fleet line (console/shared/fleet_line.py), pure: every /health shape and failed call
gets a level and a sentence that names the reason the fleet gave."""

from __future__ import annotations

import pytest

from console.shared.chat_model import ChatError
from console.shared.fleet_line import DOWN, OK, PAUSED, REFUSED, UNREACHABLE, WAITING, from_error, from_health

PAUSE = "stage 1 on pc-b is paused (the keyboard is in use)"


def ring(model: str, status: str, detail: str = "") -> dict:
    return {"ring": f"r-{model}", "model": model, "status": status, **({"detail": detail} if detail else {})}


def test_a_healthy_fleet_names_its_models():
    line = from_health(200, {"status": "ok", "rings": [ring("b-model", "ok"), ring("a-model", "ok")]})
    assert line.ok and line.level == OK and line.text == "The fleet is ready (a-model, b-model)."


@pytest.mark.parametrize("status, rings, level, words", [
    (503, [], DOWN, "serves no model yet"),
    (503, [ring("m", "down", f"{PAUSE}; no standby agent is free")], PAUSED, f"m: {PAUSE}; no standby agent is free"),
    (503, [ring("m", "down", "the connection to stage 0 is closed")], DOWN, "m: the connection to stage 0 is closed"),
    (200, [ring("m", "recovering", PAUSE)], PAUSED, f"The fleet is paused — m: {PAUSE}. Answers wait"),
    (200, [ring("m", "ok"), ring("n", "recovering", PAUSE)], PAUSED, f"Part of the fleet is paused — n: {PAUSE}"),
    (200, [ring("m", "recovering", "stage 1 (pc-c): worker exited 137")], WAITING, "recovering — m: stage 1"),
    (200, [ring("m", "ok"), ring("n", "down", PAUSE)], PAUSED, f"n: {PAUSE}"),
    (503, [ring("m", "down")], DOWN, "m: down"),  # no detail: the status itself
])
def test_a_troubled_fleet_says_which_model_and_why(status, rings, level, words):
    line = from_health(status, {"status": "x", "rings": rings})
    assert line.level == level and words in line.text and not line.ok, line


@pytest.mark.parametrize("error, level, words", [
    (ChatError("cannot reach the fleet's API at http://h/v1 (connection refused: nothing listens there)",
               unreachable=True), UNREACHABLE, "The fleet is unreachable — cannot reach"),
    (ChatError("the fleet's API at http://h/v1 answered 401: missing, wrong or revoked API key", status=401),
     REFUSED, "refused this chat's API key"),
    (ChatError("... answered 429: the key 'bob' is over its rate limit", status=429), WAITING, "busy"),
    (ChatError(f"... answered 503: the ring cannot serve now: {PAUSE}", status=503), PAUSED, PAUSE),
    (ChatError("... answered 503: no ring is serving yet", status=503), DOWN, "cannot answer now"),
    (ChatError("the fleet stopped the answer: worker lost"), DOWN, "could not answer: the fleet stopped"),
])
def test_a_failed_call_gets_a_line(error, level, words):
    line = from_error(error)
    assert line.level == level and words in line.text, line
    assert line.colour.startswith("#") and line.background.startswith("#")
