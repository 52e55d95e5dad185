"""Build: turn a checkpoint into an engine the runtime loads without conversion work."""
from kiln.build.builder import build_engine, resolve_build_config

__all__ = ["build_engine", "resolve_build_config"]
