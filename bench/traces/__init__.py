"""Request traces: the loaders, their statistics, the TraceLab converter, and the shipped Mooncake trace (data)."""
