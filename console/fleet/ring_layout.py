"""Which agent serves which stage, and whether the fleet service runs stage 0 itself: pure decisions over
a placement plan (or a hand-made list, for tests and manual setups), plus the progress events the
distribution reports per agent.

The fleet service can host stage 0 inside its own process (the coordinator computes it and sends
hidden states to stage 1), which saves one network hop. The plan decides: when its first stage
sits on the fleet service's own PC, stage 0 runs locally; every other stage needs an agent, one stage
per agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from console.fleet.errors import LayoutError
from console.fleet_api.fleet_settings import DEFAULT_DATA_PORT
from engine.control.messages import parse_hostport
from engine.errors import DeskfleetError

if TYPE_CHECKING:
    from engine.placement.types import Plan



@dataclass(frozen=True)
class AgentEndpoint:
    """How the fleet service reaches one agent: its control API ``host:port`` and the data port its
    stage worker should listen on (on the same host). ``node_id``: the agent that must answer
    there (from the fleet model, which learnt it over mutual TLS); None: learnt from the
    certificate at the first contact, then pinned."""

    control: str
    data_port: int = DEFAULT_DATA_PORT
    name: str | None = None
    node_id: str | None = None


@dataclass(frozen=True)
class AgentTarget:
    """One agent and the stage it serves (``node_id`` as in AgentEndpoint)."""

    control: str
    stage: int
    data_port: int = DEFAULT_DATA_PORT
    name: str | None = None
    node_id: str | None = None

    @property
    def host(self) -> str:
        return parse_hostport(self.control, "the agent's control address")[0]

    @property
    def port(self) -> int:
        return parse_hostport(self.control, "the agent's control address")[1]

    @property
    def data_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.data_port}"

    @property
    def label(self) -> str:
        """How reports name this agent: its name, else its control address."""
        return self.name or self.control


@dataclass(frozen=True)
class RingLayout:
    """The agents in stage order, and whether stage 0 runs in the console."""

    targets: tuple[AgentTarget, ...]
    local_stage0: bool

    @classmethod
    def of(cls, targets: Sequence[AgentTarget | tuple[str, int]]) -> RingLayout:
        """A layout from (control address, stage) pairs or targets; stage 0 is local when no
        agent serves it."""
        parsed = tuple(t if isinstance(t, AgentTarget) else AgentTarget(t[0], t[1]) for t in targets)
        ordered = tuple(sorted(parsed, key=lambda t: t.stage))
        return cls(ordered, local_stage0=bool(ordered) and ordered[0].stage != 0)

    @classmethod
    def from_plan(cls, plan: Plan, endpoints: Mapping[str, AgentEndpoint], *,
                  console_pc_id: str | None = None) -> RingLayout:
        """The ring a placement plan describes; ``endpoints`` maps each PC id to its agent."""
        local = bool(plan.stages) and console_pc_id is not None and plan.stages[0].pc_id == console_pc_id
        targets = []
        for index, stage in enumerate(plan.stages):
            if index == 0 and local:
                continue
            endpoint = endpoints.get(stage.pc_id)
            if endpoint is None:
                where = ("the fleet service's own PC, and only stage 0 can run inside the fleet service; run an agent "
                         "on this PC or place the stage elsewhere" if stage.pc_id == console_pc_id else
                         f"{stage.pc_id}, whose agent address is unknown; wait until it is discovered, add "
                         "it by address, or place the stage elsewhere")
                raise LayoutError(f"stage {index} (layers {stage.first_layer}-{stage.last_layer}) is placed on "
                                  f"{where}")
            targets.append(AgentTarget(endpoint.control, index, endpoint.data_port, endpoint.name or stage.pc_id,
                                       endpoint.node_id))
        return cls(tuple(targets), local)

    @property
    def first_agent_stage(self) -> int:
        return 1 if self.local_stage0 else 0

    def check(self, n_stages: int) -> None:
        """LayoutError unless the agents cover stages first_agent_stage..n_stages-1 once each,
        with distinct agents and distinct data addresses."""
        stages = [t.stage for t in self.targets]
        wanted = list(range(self.first_agent_stage, n_stages))
        if stages != wanted:
            where = "the fleet service runs stage 0, so agents must serve" if self.local_stage0 else "agents must serve"
            raise LayoutError(f"the export has {n_stages} stages and {where} stages {wanted}, one each; "
                              f"this layout gives agents stages {stages}. Re-plan or pick the matching export.")
        try:
            controls = [(t.host, t.port) for t in self.targets]
        except DeskfleetError as exc:
            raise LayoutError(str(exc)) from exc
        if len(set(controls)) != len(controls):
            raise LayoutError("one agent is given two stages; an agent serves one stage at a time. "
                              "Re-plan with one stage per PC.")
        data = [t.data_address for t in self.targets]
        if len(set(data)) != len(data):
            raise LayoutError(f"two stages would listen on the same data address ({data}); give each "
                              "agent its own data port")


