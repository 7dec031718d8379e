"""Collectors of host and GPU figures for the node's LoadSnapshot."""

from loadmesh.daemon.collectors.gpu import GpuCollector, GpuInfo
from loadmesh.daemon.collectors.host import HostCollector

__all__ = ["GpuCollector", "GpuInfo", "HostCollector"]
