"""The fleet service's exception hierarchy. Every message tells the admin what happened and
what to do; each class says when it is raised."""

from __future__ import annotations

from dataclasses import dataclass

from console.fleet_api.errors import FleetServiceError


class FleetStateError(FleetServiceError):
    """A file in the fleet service's state dir cannot be read, does not parse, or cannot be written; a
    file that does not parse is left in place, never overwritten."""


# -- the model library and export jobs ------------------------------------------------------------


class ModelPathError(FleetServiceError):
    """An admin added (or exported from) a path that is not a model: missing, not an HF checkpoint
    directory, not a GGUF file."""


class ExportJobError(FleetServiceError):
    """An export running in the background process failed; the message is the exporter's."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind  # the exporter's exception class name, e.g. "ExportError"


class ExportCancelledError(FleetServiceError):
    """Waited on an export job that was cancelled: nothing was written."""


class ExportTimeoutError(FleetServiceError):
    """An export job did not finish within the time the caller allowed (it keeps running)."""


class ExportNotFoundError(FleetServiceError):
    """An export id names no export in the fleet service's library."""


# -- distribution and the ring ---------------------------------------------------------------------


class DistributionError(FleetServiceError):
    """Base of the errors raised while distributing shards and bringing up the ring."""


class LayoutError(DistributionError):
    """A placement plan or target list cannot be turned into a ring: a stage without an agent,
    stages missing or doubled, or a stage count that differs from the export's."""


@dataclass(frozen=True)
class AgentFailure:
    """One agent that could not do its part, and why (the agent's own words where it gave any)."""

    agent: str
    stage: int
    message: str


class AgentsFailedError(DistributionError):
    """One or more agents failed to fetch, verify or start their stage. Agents that succeeded keep
    their verified files: running the distribution again resumes, sending only what is missing."""

    def __init__(self, failures: tuple[AgentFailure, ...]) -> None:
        self.failures = failures
        lines = "; ".join(f"{f.agent} (stage {f.stage}): {f.message}" for f in failures)
        super().__init__(f"{len(failures)} agent(s) failed: {lines}. Fix the cause and run the "
                         "distribution again; verified shards are not sent twice.")


class RingUnhealthyError(DistributionError):
    """Every worker started, but the ring did not answer a one-token test generation."""


# -- the fleet, links and placement inputs ---------------------------------------------------------


class UnknownAgentError(FleetServiceError):
    """A node id names no agent the fleet service knows (never seen, or removed)."""


class ForeignAgentError(FleetServiceError):
    """An agent cannot be approved or controlled because it has not joined this fleet service's fleet:
    it belongs to another fleet, or has joined none yet."""


class AgentUnreachableError(FleetServiceError):
    """An agent's control API did not answer in time, or refused the TLS handshake (another
    fleet's agent refuses this fleet service's certificate)."""


class AgentRefusedError(FleetServiceError):
    """An agent answered a control request with an error; ``status`` is the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class CalibrationError(FleetServiceError):
    """A model cannot be profiled for placement: too few layers for calibration stages of one
    and two layers, or its calibration export cannot be built."""


# -- failover --------------------------------------------------------------------------------------


class NoReplacementError(DistributionError):
    """A stage of the running ring stopped answering and, within the hold time, neither came back
    on its own agent (a restarted worker, a pause that ended) nor could move to a standby agent;
    the held requests fail with this message."""
