"""Checkpoint formats: kiln checkpoints/engines, external weight sources, the weights loader."""
