"""Loading weights and tokenizers: GGUF files, HF folders, random (dummy) weights."""
