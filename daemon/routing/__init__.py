"""Local routing: the best peer for a model (and session) from this node's peer table.

The public API is Router (router.py) with its inputs PeerInput and RoutingConfig and its
answers Decision and NoCandidate, each with a Reason (reasons.py); simulator.py measures
the decision against other policies on a simulated fleet.
"""

from loadmesh.daemon.routing.candidates import PeerInput, RoutingConfig
from loadmesh.daemon.routing.reasons import Reason
from loadmesh.daemon.routing.router import OUTCOMES, Alternative, Decision, NoCandidate, Outcome, Router

__all__ = ["OUTCOMES", "Alternative", "Decision", "NoCandidate", "Outcome", "PeerInput", "Reason",
           "Router", "RoutingConfig"]
