"""Routing: the cache key (block hashing), the prefix index, routing policy, cost forecast and
the trace-replay simulator. Imports neither ``workers`` nor ``cluster``."""
