"""A CUDA device simulated on the CPU that counts host synchronisations, and the sync-count command."""
