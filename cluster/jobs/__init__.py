"""Durable jobs: the SQLite job store and the runner that runs every accepted request once."""
