"""Benchmarks behind ``orchard bench``: each prints measured figures."""
