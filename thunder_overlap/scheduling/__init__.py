"""Deciding where each collective is issued and waited on around Thunder's fixed compute order,
within the prefetch, in-flight and memory limits."""
