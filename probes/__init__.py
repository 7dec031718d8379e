"""eBPF probes that fingerprint inference HTTP traffic, their loader and map reader."""
