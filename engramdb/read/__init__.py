"""The engine under every handle: read planning, the RAM tier, prefetch, local tables, view records."""
