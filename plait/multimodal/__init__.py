"""Images in prompts: reading them, their pixel values, and the placeholder tokens they fill (no torch on
the GPU here: the runner's ImageEmbeddings runs the vision tower)."""
