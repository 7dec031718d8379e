"""model_id: the FNV-1a 64-bit hash of a model name, exactly as the probes compute it in
the kernel over the bytes of the JSON "model" value, so user space can name a model it has
only seen as a number, and a router can look a model up by its name.

Outside the probes package: importing that one loads the probe loader and pyroute2,
three quarters of the router's import time when it lived there."""

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1

# The id of "no model found in the request".
NO_MODEL = 0


def model_id(name: str | bytes) -> int:
    data = name.encode() if isinstance(name, str) else name
    h = FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _MASK
    return h
