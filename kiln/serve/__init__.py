"""kiln's OpenAI-compatible HTTP server: ``create_app(engine_dir)`` or ``kiln serve MODEL``."""
from __future__ import annotations


def create_app(*args, **kwargs):
    from kiln.serve.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["create_app"]
