"""What every ``kiln eval`` command shares: the Hugging Face model beside kiln, the JSON record,
the summary table."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from kiln.bench.peer import load_hf_peer
from kiln.errors import ConfigError


def load_hf_model(path: str | Path, dtype: str):
    """Hugging Face transformers' own load of ``path`` (a model directory or a ``.gguf`` file) in
    ``dtype`` (a kiln dtype name), in eval mode; returns (model, seconds)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--hf_model_dir {path}: no such directory or file")
    if path.suffix == ".gguf":
        return load_hf_peer(dtype, gguf=str(path))
    return load_hf_peer(dtype, model_dir=str(path))


def write_json(path: str | Path, record: dict) -> None:
    """Write ``record`` to ``path`` whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_table(header: list[str], rows: list[list]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned; floats to
    two decimals, None as '-'."""
    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    cells = [header] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for r in cells:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)
