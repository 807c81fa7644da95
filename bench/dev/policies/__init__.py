"""Replay baselines, the offline reference, experimental walks and the state-slot budget model."""
