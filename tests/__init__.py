"""The test suite, by layer: one folder per package of the library (radix, components,
allocators, hicache, storage, lora, sglang) and of the bench (bench, gpu, model), reliability
across them, and helpers/ (reference models, harnesses, shared builders). Markers come from each
module's file name (conftest.py)."""
