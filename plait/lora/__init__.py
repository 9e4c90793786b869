"""Multi-LoRA serving: PEFT adapters, the slots they are served from, and the layers that add their deltas."""
