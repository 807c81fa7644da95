"""L3 storage benchmarks: backend throughput and engines sharing one store."""
