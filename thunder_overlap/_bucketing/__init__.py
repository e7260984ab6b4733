"""Buckets: which parameters share one collective (the plan) and the persistent buffers and
runtime that move them."""
