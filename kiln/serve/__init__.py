"""kiln's OpenAI-compatible HTTP server: ``create_app(engine_dir)`` or ``kiln serve MODEL``."""
from kiln.serve.app import create_app

__all__ = ["create_app"]
