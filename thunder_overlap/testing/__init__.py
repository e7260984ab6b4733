"""Scaffolding for tests, benchmarks and the demo, not part of the library's pipeline: TinyGPT,
a deterministic training loop, a local multi-rank launcher, the op census, the live-memory
tracker and the memory estimator's runtime check."""
