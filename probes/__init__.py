"""eBPF probes that fingerprint inference HTTP traffic, and the reader of their maps.

ProbeSet compiles and attaches the probes (ProbeUnavailable says why it cannot);
FingerprintReader turns their maps into per-model figures and the fingerprint report;
loadmesh.model_id.model_id(name) is the id the probes give a model (outside this package,
so that routing can name models without importing the loader). This package imports
neither daemon nor gossip.
"""

from . import buckets
from .loader import MapSizes, ProbeSet, ProbeUnavailable
from .reader import FingerprintReader, ModelStats

__all__ = ["FingerprintReader", "MapSizes", "ModelStats", "ProbeSet", "ProbeUnavailable",
           "buckets"]
