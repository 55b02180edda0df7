"""A simulated fleet: many lightweight fake agents, in a few worker processes, against a real
fleet service over loopback, speaking the real protocols with mutual TLS.

Each fake agent (:class:`~tests.support.sim_fleet.agent.SimAgent`) joins with a join token
through the real enrolment (``engine.control.enrollment.async_join``: its own EC key, a CSR, a
fleet certificate back), serves the real control API (``agent.service.control_api.build_app``
over ``Credentials.server_context()``, mutual TLS) answering the service's status polls, pause,
resume and deny-list pushes, registers at the hub at the real interval (30 s, the real agent's
``async_register_with_seeds``) and pauses / resumes itself at random at a stated fleet-wide rate
(a person at the PC; the hub is told as the real agent tells it). Nothing behind the control API
is real: no worker, no shards; routes that would start work answer 409.

Async use (a loop of your own; ``admin`` an AdminClient, the service's state dir, or its socket)::

    from tests.support.sim_fleet import SimFleet

    async with SimFleet(state_dir, agents=200, flap_per_s=2.0) as sim:   # joined, registered, approved
        sim.stats.joined          # name -> node id
        sim.set_flap_rate(5.0)    # pauses + resumes per second, all agents together
        ...

Blocking use (the fleet runs on a loop thread of its own; ``admin`` must be a path)::

    with SimFleet(state_dir, agents=1000, flap_per_s=2.0) as sim:
        ...
        sim.call(lambda: sim.set_flap_rate(0))

Options: ``processes`` (default one per 250 agents), ``register_s`` (30), ``approve`` (True: once
every agent is listed verified, each is approved through the admin API), ``tokens`` ("single":
one single-use token per agent; "reusable": one token of N uses, auto-approving when
``approve``, where the service has those), ``prefix`` (agent names ``<prefix>-0000``...; use a
unique one per run), ``on_progress`` (a callable taking one line of text). ``sim.stats``
(:class:`SimStats`) keeps the join and registration round trips, polls answered, pauses told,
remote pauses seen and errors. ``sim.pids`` are the worker processes.

From a shell, against a running ``deskfleet fleet``::

    python -m tests.support.sim_fleet --state-dir ~/.local/share/deskfleet/fleet --agents 100 --flap-per-s 1
"""

__all__ = ["REGISTER_INTERVAL_S", "SimFleet", "SimFleetError", "SimStats"]


def __getattr__(name: str):
    # lazily: a worker process (``-m tests.support.sim_fleet.worker``) imports this package too, and
    # must not pay for the controller's imports (the admin client pulls in the placement solver)
    if name in __all__:
        from tests.support.sim_fleet import fleet

        return getattr(fleet, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
