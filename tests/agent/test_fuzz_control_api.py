"""Hostile input against a live agent's control API over mutual TLS (issue 7).

One joined agent and a console half on loopback for the module; hypothesis drives it through a
keep-alive HTTPS connection with the console's certificate (and, for some cases, an agent's):
assignments with one field mutated or a mutated manifest (re-hashed so the deeper checks run),
random methods, paths, bodies and content types, and bodies over the 4 MiB limit. Every request
must be answered within the timeout, never with a 5xx or a traceback; a refused assignment must
match what the pure parser says, answer the documented error body and leave the saved state
alone. The hub publishes nothing, so an accepted assignment can never start a worker.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.service.service import AgentService
from agent.service.settings import AgentSettings
from engine.control.messages import (
    Assignment,
    ControlRequestError,
    WorkerSettings,
    parse_node_id,
    parse_node_ids,
)
from engine.trust.fleet_ca import Role
from tests.support.agent_helpers import FakeIdle, console
from tests.support.fuzz_helpers import (
    CONTENT_TYPES,
    LIVE_FUZZ,
    METHODS,
    RAW_BODIES,
    HttpClient,
    assert_answered,
    assert_clean_refusal,
    dumps,
    fuzz_settings,
    json_values,
    loop_thread,
    paths,
)
from tests.support.loopback import free_port

# The agent's zeroconf and aiohttp threads draw from `random` while hypothesis generates examples.
pytestmark = LIVE_FUZZ

CASES = {"control API: mutated assignments": 900, "control API: random requests": 800,
         "control API: oversized bodies": 12, "control API: deny lists and measure targets": 200}
ROUTES = ("/v1/status", "/v1/probe", "/v1/assign", "/v1/fetch", "/v1/worker/start", "/v1/worker/stop",
          "/v1/drain", "/v1/pause", "/v1/resume", "/v1/link/echo", "/v1/link/measure", "/v1/calibrate",
          "/v1/link/expect", "/v1/deny", "/v1/fleet-api")


@dataclass
class LiveAgent:
    agent: AgentService
    console: HttpClient  # certificate with the console role: may command
    member: HttpClient  # another agent of the fleet: may only read
    good: dict
    state_file: object


def _error_body(doc) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict) and bool(doc["error"].get("message"))


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_export):
    export = tiny_export("llama", 2)
    root = tmp_path_factory.mktemp("fuzz-control")
    with pytest.MonkeyPatch.context() as mp, loop_thread() as loop:
        mp.setenv("DESKFLEET_KEYRING_DIR", str(root / "keyring"))
        host_cm = console(root / "console", {})
        con = loop.run(host_cm.__aenter__())
        settings = AgentSettings(name="fuzz-desk", interface="127.0.0.1", control_port=0, data_port=0)
        agent = AgentService(root / "agent", settings, idle_source=FakeIdle(1e6), power=lambda: None)
        loop.run(agent.async_start())
        try:
            loop.run(agent.async_join(con.enrollment, con.token()))
            good = Assignment.create((export / "manifest.json").read_text(), export_id="tiny-2", stage=1,
                                     source=con.hub.shard_url("tiny-2"), listen_port=free_port(),
                                     next_hop="127.0.0.1:9", worker=WorkerSettings(threads=1)).to_dict()
            member = con.authority.issue_credentials("desk-2", role=Role.AGENT)
            clients = [HttpClient("127.0.0.1", agent.control_port, c.client_context())
                       for c in (con.credentials, member)]
            yield LiveAgent(agent, *clients, good, root / "agent" / "state.json")
            for c in clients:
                c.close()
        finally:
            loop.run(agent.async_close())
            loop.run(host_cm.__aexit__(None, None, None))



def _verdict(body: dict) -> str:
    """What the pure parser says of an assignment: "ok" or "refused"."""
    try:
        Assignment.from_dict(body)
    except ControlRequestError:
        return "refused"
    return "ok"


FIELDS = ("export_id", "stage", "manifest_json", "manifest_sha256", "source", "listen_port", "next_hop",
          "worker", "worker.device", "worker.threads", "worker.exact", "api_url", "events_url",
          "expect_upstream", "expect_next", "deny")
NODE_IDS = st.sampled_from(["a" * 64, "A" * 64, "0" * 63, "g" * 64, "a" * 65, "", " " + "a" * 63]) | \
    st.text("0123456789abcdef", min_size=64, max_size=64)
BAD_VALUES = {
    "export_id": st.sampled_from(["", "../up", "a/b", "x" * 200, ".hidden", "tiny 2", "\u00e9t\u00e9"]),
    "stage": st.sampled_from([-1, 2, 99, 2**63, True, 1.0, "1"]),
    "source": st.sampled_from(["http://127.0.0.1/x/", "https://h/no-slash", "file:///etc/", "https://", ""]),
    "listen_port": st.sampled_from([-1, 65536, 2**40, 1.5, "80", False]),
    "next_hop": st.sampled_from(["nowhere", "h:0", "h:65536", ":1", "a:b", "x" * 300 + ":1", "[::1]"]),
    "worker.device": st.sampled_from(["TPU", "GPU.", "cpu", "", "CPU;rm", "NPU.0"]),
    "worker.threads": st.sampled_from([0, -1, 1025, 2**70, 1.5, "2"]),
    "api_url": st.sampled_from(["ftp://x", "javascript:alert(1)", "", "//x"]),
    "expect_upstream": st.lists(NODE_IDS, max_size=3) | st.just(["a" * 64] * 1025),
    "expect_next": NODE_IDS,
    "deny": st.lists(NODE_IDS, max_size=3) | st.just("a" * 64),
}


TRAVERSAL_PATHS = ("../../../etc/passwd", "/etc/passwd", "stage_1/../../x", "..", "", "a\\..\\b", "stage_1/./x",
                   "stage_1/%2e%2e/x", "C:\\Windows\\x", "stage_1/\u0000")


def _mutate_manifest(manifest_json: str, data: st.DataObject) -> str:
    """The manifest with one value somewhere inside replaced (paths, sizes, hashes, stages...)."""
    doc = json.loads(manifest_json)
    if data.draw(st.booleans(), label="file path"):
        files = doc["stages"][1]["files"]
        files[data.draw(st.integers(0, len(files) - 1))]["path"] = data.draw(st.sampled_from(TRAVERSAL_PATHS))
        return json.dumps(doc)
    parent, key, node = None, None, doc
    for _ in range(data.draw(st.integers(1, 6), label="depth")):
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            break
        key = data.draw(st.sampled_from(keys), label="key")
        parent, node = node, node[key]
    if parent is None:
        return json.dumps(data.draw(json_values(6)))
    parent[key] = data.draw(json_values(6), label="value")
    return json.dumps(doc)


@st.composite
def assignments(draw, good: dict) -> dict:
    body = copy.deepcopy(good)
    how = draw(st.sampled_from(["field", "field", "drop", "extra", "manifest", "manifest"]))
    if how == "manifest":
        mutated = _mutate_manifest(body["manifest_json"], draw(st.data()))
        body["manifest_json"] = mutated
        if draw(st.integers(0, 9)):  # re-hashed, so the checks behind the hash are reached
            body["manifest_sha256"] = hashlib.sha256(mutated.encode()).hexdigest()
        return body
    name = draw(st.sampled_from(FIELDS))
    value = draw(BAD_VALUES[name] | json_values(6) if name in BAD_VALUES else json_values(6))
    top, _, sub = name.partition(".")
    if how == "drop":
        body.pop(top, None)
    elif how == "extra":
        body[draw(st.text(max_size=10))] = value
    elif sub:
        if not isinstance(body.get(top), dict):
            body[top] = {}
        body[top][sub] = value
    else:
        body[top] = value
    return body


def test_fuzz_mutated_assignments_are_refused_like_the_parser_refuses_them(live):
    ran = []

    @fuzz_settings(CASES["control API: mutated assignments"])
    @given(body=assignments(live.good), content_type=st.sampled_from(CONTENT_TYPES))
    def case(body, content_type):
        ran.append(1)
        before = live.state_file.read_bytes() if live.state_file.exists() else b""
        reply = live.console.request("POST", "/v1/assign", dumps(body), {"Content-Type": content_type})
        assert_answered(reply, "assign")
        if _verdict(body) == "ok":
            assert reply.status == 200, reply.body[:300]
        else:
            assert_clean_refusal(reply, "assign", json_error=_error_body)
            assert reply.status == 400
            after = live.state_file.read_bytes() if live.state_file.exists() else b""
            assert after == before, "a refused assignment changed the saved state"

    case()
    assert len(ran) >= CASES["control API: mutated assignments"]


def _sanitise(path: str, body):
    # A valid link-measure target would make the agent dial it: keep every target unusable.
    if "measure" in path and isinstance(body, dict) and "target" in body:
        body = {**body, "target": "not a host"}
    return body


def test_fuzz_random_requests_never_get_a_server_error(live):
    ran = []
    known = {(m, r) for r in ROUTES for m in (("GET", "HEAD") if r in ROUTES[:2] or r == "/v1/link/echo"
                                               else ("POST",))}

    @fuzz_settings(CASES["control API: random requests"])
    @given(method=st.sampled_from(METHODS), path=st.sampled_from(ROUTES) | paths(ROUTES),
           body=json_values() | st.sampled_from(RAW_BODIES) | st.binary(max_size=200),
           content_type=st.sampled_from(CONTENT_TYPES), as_member=st.integers(0, 4).map(lambda i: i == 0))
    def case(method, path, body, content_type, as_member):
        ran.append(1)
        body = _sanitise(path, body)
        raw = body if isinstance(body, bytes) else dumps(body)
        client = live.member if as_member else live.console
        reply = client.request(method, path, raw, {"Content-Type": content_type})
        what = f"{method} {path} as {'member' if as_member else 'console'}"
        assert_answered(reply, what)
        route = path.split("?")[0]
        if as_member and method == "POST" and route in ROUTES[2:] and route != "/v1/link/echo":
            assert_clean_refusal(reply, what, json_error=_error_body)
            assert reply.status == 403
        elif (method, route) not in known and method != "HEAD":
            assert_clean_refusal(reply, what)
        elif reply.status >= 400 and method != "HEAD":
            assert_clean_refusal(reply, what, json_error=_error_body)

    case()
    assert len(ran) >= CASES["control API: random requests"]
    status = live.console.request("GET", "/v1/status")
    assert status.status == 200 and status.json()["state"] in ("idle", "paused", "error", "fetching")


def test_fuzz_oversized_bodies_are_413(live):
    ran = []

    @fuzz_settings(CASES["control API: oversized bodies"])
    @given(path=st.sampled_from([r for r in ROUTES[2:] if r != "/v1/link/echo"]),  # the POST routes (echo: GET)
           extra=st.integers(1, 2 << 20), as_json=st.booleans())
    def case(path, extra, as_json):
        ran.append(1)
        size = (4 << 20) + extra
        body = (b'{"x": "' + b"a" * (size - 9) + b'"}') if as_json else b"\x00" * size
        reply = live.console.request("POST", path, body, {"Content-Type": "application/json"})
        assert_clean_refusal(reply, f"{size} B to {path}")
        assert reply.status == 413

    case()
    assert len(ran) >= CASES["control API: oversized bodies"]
    assert live.console.request("GET", "/v1/probe").status == 200


def _peer_verdict(path: str, body) -> str:
    try:
        if not isinstance(body, dict):
            return "refused"
        if path == "/v1/deny":
            parse_node_ids(body.get("deny"), "deny")
        else:
            parse_node_id(body.get("node_id"), "node_id")
    except ControlRequestError:
        return "refused"
    return "ok"


def test_fuzz_deny_lists_and_measure_targets_are_taken_exactly_when_well_formed(live):
    ran = []
    key = {"/v1/deny": "deny", "/v1/link/expect": "node_id"}

    @fuzz_settings(CASES["control API: deny lists and measure targets"])
    @given(path=st.sampled_from(sorted(key)), data=st.data())
    def case(path, data):
        ran.append(1)
        value = data.draw(st.lists(NODE_IDS, max_size=4) | NODE_IDS | json_values(4), label="value")
        body = data.draw(st.sampled_from([{key[path]: value}, {"other": value}, value]), label="body")
        before = live.state_file.read_bytes()
        reply = live.console.request("POST", path, dumps(body), {"Content-Type": "application/json"})
        assert_answered(reply, path)
        if _peer_verdict(path, body) == "ok":
            assert reply.status == 200, reply.body[:300]
            if path == "/v1/deny":
                assert live.agent.deny == set(parse_node_ids(body.get("deny"), "deny"))
        else:
            assert_clean_refusal(reply, path, json_error=_error_body)
            assert reply.status == 400 and live.state_file.read_bytes() == before

    case()
    assert len(ran) >= CASES["control API: deny lists and measure targets"]
    assert live.console.request("POST", "/v1/deny", dumps({"deny": []})).status == 200
    assert live.agent.deny == frozenset()


def test_the_agent_still_serves_its_control_api(live):
    reply = live.console.request("GET", "/v1/status")
    assert reply.status == 200 and reply.json()["node_id"] == live.agent.status().node_id
