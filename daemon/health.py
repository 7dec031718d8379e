"""What each of the agent's components reports about itself, and what the agent asks of them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class HealthState(enum.StrEnum):
    OK = "ok"
    DEGRADED = "degraded"  # running, but without something it should have (a reason says what)
    OFF = "off"            # not running at all on this host (a reason says why)


@dataclass(frozen=True)
class Health:
    state: HealthState
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.state}: {self.reason}" if self.reason else str(self.state)

    def as_json(self) -> dict[str, str]:
        return {"state": str(self.state), "reason": self.reason}


OK = Health(HealthState.OK)


class StartupError(Exception):
    """A component cannot run and the agent must not run without it; str() is the reason.
    config: a file the operator must fix (exit 78, which the unit does not restart into)."""

    def __init__(self, reason: str, config: bool = False) -> None:
        super().__init__(reason)
        self.config = config


class Component(Protocol):
    """A part of the agent with a lifetime: started in order, stopped in reverse order.

    start() either succeeds (possibly degraded), or raises StartupError after releasing
    whatever it had taken. stop() releases everything and never raises.
    """

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def health(self) -> Health: ...
