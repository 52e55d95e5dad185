"""kiln's environment switches, read in one place.

| variable | default | effect |
|---|---|---|
| ``KILN_CACHE_DIR`` | ``~/.cache/kiln`` | engines built from sources, compiled native kernels |
| ``KILN_NATIVE_KERNELS`` | ``1`` | ``0``: run the PyTorch paths, never compile the C kernels |
| ``KILN_AMX`` | ``1`` | ``0``: the bf16/int8 panel kernels skip AMX tiles (AVX-512 dot products instead) |
| ``KILN_HUGE_PAGES`` | ``1`` | ``0``: weights and caches on ordinary 4 KiB pages |
| ``KILN_API_KEY`` | unset | ``kiln serve``'s API key when ``--api_key`` is not given |
"""
from __future__ import annotations

import os
from pathlib import Path


def _on(name: str) -> bool:
    return os.environ.get(name, "1") != "0"


def cache_dir() -> Path:
    """Where built engines and compiled kernels are cached."""
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln"))


def native_kernels_enabled() -> bool:
    return _on("KILN_NATIVE_KERNELS")


def amx_enabled() -> bool:
    return _on("KILN_AMX")


def huge_pages_enabled() -> bool:
    return _on("KILN_HUGE_PAGES")


def api_key() -> str | None:
    return os.environ.get("KILN_API_KEY")
