"""The mesh: LoadSnapshot and its wire codec, membership and merge, UDP transport."""
