"""Why the router answered as it did: each reason's text, for people (the API's `reason`),
and its label, for the exporter (loadmesh_route_decisions{reason=...})."""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """A str equal to its text, so that answers serialise as they read."""

    label: str

    def __new__(cls, text: str, label: str) -> Reason:
        member = str.__new__(cls, text)
        member._value_ = text
        member.label = label
        return member

    # A peer chosen.
    POWER_OF_D = "power of d choices", "power_of_d_choices"
    STALE_VIEW = "stale view: no candidate has a fresh snapshot", "stale_view"
    SESSION = "session", "session"
    SESSION_MOVED = "session moved along the ring", "session_moved_along_the_ring"
    SESSION_PASSED_ON = "session passed on by every peer", "session_passed_on_by_every_peer"
    SESSION_HEAVY = "heavy session on its placed peer", "heavy_session"
    SESSION_OVERFLOW = "session's peer queueing: the next along its ring", "session_overflow"
    # None: every peer serving the model is unusable for one cause, or for mixed causes.
    UNKNOWN_MODEL = "unknown model", "unknown_model"
    ALL_DEAD = "all dead", "all_dead"
    ALL_DRAINING = "all draining", "all_draining"
    NO_ENDPOINT = "no endpoint", "no_endpoint"
    ALL_EXCLUDED = "all excluded", "all_excluded"
    ALL_CIRCUITS_OPEN = "all circuits open", "all_circuits_open"
    NO_USABLE_PEER = "no usable peer", "no_usable_peer"
