"""loadmesh: a per-host agent that routes GPU inference requests to the right peer.

Its parts keep their folders at the root of the source tree and are mapped under this
package by pyproject.toml's package-dir: probes/ is loadmesh.probes (the eBPF probes and
their reader), daemon/ is loadmesh.daemon (the agent, its CLI and API), gossip/ is
loadmesh.gossip (the mesh). Only `loadmesh` is installed at top level: python-daemon owns
the import name `daemon`. This file is the whole of src/loadmesh.
"""
