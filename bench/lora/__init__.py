"""LoRA adapters in the bench: the LoRA-aware scheduler and the replay with adapters."""
