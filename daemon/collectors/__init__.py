"""Collectors of host and GPU figures for the node's LoadSnapshot."""

from daemon.collectors.gpu import GpuCollector, GpuInfo
from daemon.collectors.host import HostCollector

__all__ = ["GpuCollector", "GpuInfo", "HostCollector"]
