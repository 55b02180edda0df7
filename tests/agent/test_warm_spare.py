"""The warm spare: a second worker process with the stage compiled, promoted when the worker dies.

Pure parts first (restart delays, the memory decision, the activation line); then real worker
processes under a real WorkerSupervisor on loopback: the worker SIGKILLed, the spare's pid
serving on the same port at once, a new spare behind it. The console's ring over real agents
(the spare used on a restart in place and on a move to a standby, answers identical) is
tests/agent/test_spare_failover.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import threading
import time

import pytest

from agent.service.spare_policy import RESERVE_BYTES, spare_decision
from agent.service.supervisor import Backoff, WorkerSupervisor, worker_args
from agent.service.worker_process import WorkerLaunch
from engine.wire.address import Address
from engine.worker.spare import SPARE_PREFIX, ActivationError, parse_activation
from engine.worker.status_lines import READY_PREFIX
from tests.support.asyncutil import run
from tests.support.loopback import free_port

GIB = 1 << 30
A, B, C = "a" * 64, "b" * 64, "c" * 64  # node ids


def test_the_first_crash_restarts_at_once_and_a_second_within_the_window_backs_off():
    backoff = Backoff(first_s=1.0, factor=2.0, max_s=5.0)
    assert [backoff.delay(n) for n in (1, 2, 3, 4, 5)] == [0.0, 1.0, 2.0, 4.0, 5.0]


def test_auto_keeps_a_spare_only_when_free_memory_holds_it_and_the_reserve():
    stage = 2 * GIB  # a compiled 2 GiB stage takes 2.5 GiB
    assert spare_decision("auto", stage_bytes=stage, available_bytes=4 * GIB, worker_running=True).keep
    assert not spare_decision("auto", stage_bytes=stage, available_bytes=3 * GIB, worker_running=True).keep
    # before the worker starts, its own weights and KV pool are counted too
    why = spare_decision("auto", stage_bytes=stage, available_bytes=4 * GIB, kv_pool_bytes=GIB)
    assert not why.keep and "only 4096 MiB are free" in why.why
    assert spare_decision("auto", stage_bytes=stage, available_bytes=7 * GIB + RESERVE_BYTES, kv_pool_bytes=GIB).keep
    assert not spare_decision("auto", stage_bytes=1, available_bytes=None).keep
    assert spare_decision("on", stage_bytes=stage, available_bytes=0).keep
    assert not spare_decision("off", stage_bytes=1, available_bytes=1 << 50).keep


def test_a_spare_matches_a_launch_that_differs_only_in_addresses_and_peer_policy():
    args = worker_args("/shards/x", 1, "127.0.0.1:7001", "127.0.0.1:7002", device="CPU", threads=1, exact=True,
                       tls=True, paged=True, kv_pool_mb=64)
    creds = {"ca_pem": "ca", "cert_pem": "c", "key_pem": "k"}
    launch = WorkerLaunch(args, json.dumps({**creds, "expect_next": A}).encode(), keep_stdin=True)
    spare = launch.as_spare()
    assert "--spare" in spare.args and spare.keep_stdin
    moved = WorkerLaunch(worker_args("/shards/x", 1, "127.0.0.1:7101", "127.0.0.1:7102", device="CPU", threads=1,
                                     exact=True, tls=True, paged=True, kv_pool_mb=64),
                         json.dumps({**creds, "expect_next": B, "deny": [C]}).encode(), keep_stdin=True)
    assert spare.spare_key() == moved.spare_key()
    other_stage = WorkerLaunch(worker_args("/shards/x", 0, "127.0.0.1:7001", "127.0.0.1:7002", device="CPU",
                                           threads=1, exact=True, tls=True, paged=True, kv_pool_mb=64),
                               launch.stdin, keep_stdin=True)
    assert other_stage.spare_key() != launch.spare_key()
    other_fleet = WorkerLaunch(args, json.dumps({**creds, "cert_pem": "other"}).encode(), keep_stdin=True)
    assert other_fleet.spare_key() != launch.spare_key()

    activation = parse_activation(json.loads(moved.activation()))
    assert (activation.listen, activation.next_hop) == (Address("127.0.0.1", 7101), Address("127.0.0.1", 7102))
    assert activation.peers is not None and activation.peers.next == B and C in activation.peers.deny


@pytest.mark.parametrize("line, message", [
    ({"activate": {"listen": "127.0.0.1:1"}}, "an activation must be"),
    ({"activate": {"listen": "nowhere", "next": "127.0.0.1:1"}}, "not HOST:PORT"),
    ({"activate": {"listen": "127.0.0.1:1", "next": "127.0.0.1:2"}, "expect_nxt": "a"}, "peer policy is invalid"),
])
def test_a_bad_activation_is_refused_saying_what_is_wrong(line, message):
    with pytest.raises(ActivationError, match=message):
        parse_activation(line)


HANG_GUARD_S = 60  # waits for what must happen; how fast it happens is the failover benchmark's


async def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        await asyncio.sleep(0.05)


async def _connects(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


@pytest.mark.slow
def test_a_killed_worker_is_replaced_by_its_spare_on_the_same_port_and_a_new_spare_follows(tiny_export):
    export = tiny_export("llama", 2)
    listen, next_port = free_port(), free_port()
    launch = WorkerLaunch(worker_args(str(export), 1, f"127.0.0.1:{listen}", f"127.0.0.1:{next_port}",
                                      device="CPU", threads=1, exact=True, tls=False, paged=True, kv_pool_mb=16),
                          keep_stdin=True)

    async def main():
        supervisor = WorkerSupervisor(spare_delay_s=0.0)
        supervisor.want_spare = True
        try:
            await supervisor.async_start(launch)
            await supervisor.async_wait_ready(60)
            first = supervisor.pid
            await _wait(lambda: supervisor.spare_ready, 60, "no spare was compiled")
            spare = supervisor.spare_pid
            assert spare not in (None, first)
            killed = time.time()  # wall clock, as the workers' timing lines
            os.kill(first, signal.SIGKILL)
            await _wait(lambda: supervisor.pid == spare and supervisor.status.state == "running", HANG_GUARD_S,
                        "the spare did not take over")
            assert await _connects(listen)  # it listens where the dead worker did
            status = supervisor.status
            assert status.restarts == 1 and status.last_error is None  # counted as a restart, and serving
            await _wait(lambda: supervisor.spare_pid not in (None, spare), HANG_GUARD_S, "no new spare was started")
            promoted = [s for s in supervisor.starts if s["promoted"]]
            assert [s["pid"] for s in promoted] == [spare]
            # no compile after the kill: the spare was compiled and warmed before it; it only binds and dials
            assert promoted[0]["opened"] <= promoted[0]["warmed"] <= killed <= promoted[0]["activated"]
            assert promoted[0]["activated"] <= promoted[0]["listening"] <= promoted[0]["ready"]
            assert supervisor.status.state == "running"  # no back-off on a first crash
        finally:
            await supervisor.async_stop()
            assert supervisor.pid is None and supervisor.spare_pid is None

    run(main())  # how fast the spare takes over: the failover benchmark's restart rows (activate_s)


def test_a_spare_without_tls_refuses_an_activation_off_loopback():
    line = {"activate": {"listen": "0.0.0.0:7301", "next": "127.0.0.1:7302"}}
    with pytest.raises(ActivationError, match="without TLS"):
        parse_activation(line, tls=False)
    with pytest.raises(ActivationError, match="next address 10.99.0.2:7302"):
        parse_activation({"activate": {"listen": "127.0.0.1:7301", "next": "10.99.0.2:7302"}}, tls=False)
    assert parse_activation(line, tls=True).listen == Address("0.0.0.0", 7301)  # with credentials: TLS on the wire
    assert parse_activation({"activate": {"listen": "[::1]:7301", "next": "localhost:7302"}}, tls=False)


@pytest.mark.slow
def test_a_plaintext_spare_told_to_listen_on_every_address_stays_off_the_network(tiny_export):
    """The attacker's line (as the reviewer sent it) to a real plaintext spare: refused, the spare keeps
    waiting and listens nowhere; the agent's own loopback activation then puts it in place."""
    import subprocess
    import sys

    export = tiny_export("llama", 2)
    listen, exposed, next_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "worker", "--shard", str(export), "--stage",
                             "1", "--spare", "--listen", f"127.0.0.1:{listen}", "--next", f"127.0.0.1:{next_port}",
                             "--threads", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()

    def next_line_with(text: str, what: str) -> str:
        """The spare's next stdout line holding ``text``; fails (not hangs) after the 120 s guard."""
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"the spare never {what}") from None
            if text in line:
                return line

    try:
        deadline = time.monotonic() + 120
        next_line_with(SPARE_PREFIX, "compiled")
        proc.stdin.write(json.dumps({"activate": {"listen": f"0.0.0.0:{exposed}",
                                                  "next": f"127.0.0.1:{next_port}"}}) + "\n")
        proc.stdin.flush()
        time.sleep(1.0)
        assert proc.poll() is None
        assert not run(_connects(exposed))  # not listening on the network address
        proc.stdin.write(json.dumps({"activate": {"listen": f"127.0.0.1:{listen}",
                                                  "next": f"127.0.0.1:{next_port}"}}) + "\n")
        proc.stdin.flush()
        line = next_line_with(READY_PREFIX, "took the loopback activation")
        assert f"127.0.0.1:{listen}" in line
        assert not run(_connects(exposed))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            err = proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1]
    assert "without TLS" in err, err
