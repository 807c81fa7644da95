"""Radix operations against SGLang's own caches on the same seeded workloads."""
