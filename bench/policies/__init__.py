"""Replay-only state and KV-leaf policies: the registry of baselines by name and the state walks the
simulator runs (``marconi``'s, ``belady_state``); the other baselines register from :mod:`bench.dev`."""
