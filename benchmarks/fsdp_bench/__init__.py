"""Shared pieces of the scripts in benchmarks/: options, models, implementations, the timed loop,
results, and the slow-link testbed's network setup."""
