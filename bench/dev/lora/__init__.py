"""LoRA adapter load cost from PEFT directories."""
