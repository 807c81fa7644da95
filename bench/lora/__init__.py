"""LoRA adapters in the bench: load cost, the LoRA-aware scheduler and the replay with adapters."""
