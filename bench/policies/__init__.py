"""Replay-only state and KV-leaf policies: the baselines and experiments registered by name, the offline reference, utility baselines, and the hit breakdown."""
