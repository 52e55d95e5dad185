"""Fetch llama.cpp's own Hugging Face -> GGUF converter (``convert_hf_to_gguf.py``, its
``conversion`` package and its bundled ``gguf-py``) from the llama-cpp-python sdist on PyPI.

The sdist vendors llama.cpp's source tree; only the converter's files are extracted (about
5 MB of the 77 MB archive), nothing is built. The converter's one requirement the project
lacks, ``sentencepiece`` (imported by the Llama / Qwen vocabulary code even when a model has
no ``tokenizer.model``), is installed next to it, so kiln's own environment is left as is.

Both ``make install`` and ``tests.utils.llama_cpp_gguf`` run this (the helper when the
converter is missing or was fetched for another version). The pinned version lives in the
Makefile (``LLAMA_CPP_PYTHON_VERSION``); this script reads it from there by default.

    python tests/utils/fetch_llama_cpp_converter.py [--version X.Y.Z] [--dest DIR] [--force]
"""
from __future__ import annotations

import argparse
import fcntl
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / ".venv" / "llama.cpp-convert"
# The converter's requirements (vendor/llama.cpp/requirements) allow sentencepiece <0.3.
SENTENCEPIECE = "sentencepiece==0.2.3"
# What the converter reads, relative to vendor/llama.cpp: the script, the package it imports
# its model classes from, the gguf-py it puts first on sys.path, the chat templates some
# classes embed, and the vocabularies its builtin-vocab fallback (Mamba, OpenELM) and
# tests.utils.llama_cpp_gguf's GPT-2 tokenizer read.
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "gguf-py/LICENSE", "models/templates/",
           "models/ggml-vocab-gpt-2.gguf", "models/ggml-vocab-gpt-neox.gguf", "models/ggml-vocab-llama-spm.gguf",
           "LICENSE")
STAMP = "VERSION"  # holds the llama-cpp-python version the directory was extracted from


def pinned_version() -> str:
    """``LLAMA_CPP_PYTHON_VERSION`` from the repository's Makefile."""
    m = re.search(r"^LLAMA_CPP_PYTHON_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    if not m:
        raise RuntimeError("Makefile does not set LLAMA_CPP_PYTHON_VERSION")
    return m[1]


def is_current(dest: Path, version: str) -> bool:
    stamp = dest / STAMP
    return stamp.is_file() and stamp.read_text().strip() == version


def fetch(version: str | None = None, dest: Path = DEFAULT_DEST, force: bool = False) -> Path:
    """Make ``dest`` hold the converter of llama-cpp-python ``version`` (the Makefile's pin by
    default); returns ``dest``. A no-op when it already does; safe to run concurrently."""
    version = version or pinned_version()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds it done
        if is_current(dest, version) and not force:
            return dest
        with tempfile.TemporaryDirectory(prefix="llama-cpp-python-sdist-") as tmp:
            tmp = Path(tmp)
            pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check", "--no-input"]
            # The sdist only: --no-binary keeps pip off the wheels, --no-deps off its dependencies.
            _run([*pip, "download", "--no-deps", "--no-binary", ":all:", "--dest", str(tmp / "dl"),
                  f"llama-cpp-python=={version}"])
            (sdist,) = (tmp / "dl").glob("llama_cpp_python-*.tar.gz")
            staged = tmp / "convert"
            _extract(sdist, staged)
            _run([*pip, "install", "--no-deps", "--only-binary", ":all:", "--no-compile", "--target",
                  str(staged / "deps"), SENTENCEPIECE])
            (staged / STAMP).write_text(version + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            shutil.move(str(staged), str(dest))
    return dest


def _extract(sdist: Path, out: Path) -> None:
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        prefix = f"{top}/vendor/llama.cpp/"
        wanted = []
        for m in tar.getmembers():
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel and ".." not in rel.split("/") and (m.isfile() or m.isdir()) and any(
                    rel == w or (w.endswith("/") and rel.startswith(w)) for w in MEMBERS):
                m.name = rel
                wanted.append(m)
        missing = [w for w in MEMBERS if not any(m.name == w or m.name.startswith(w) for m in wanted)]
        if missing:
            raise RuntimeError(f"{sdist.name} lacks vendor/llama.cpp/{', '.join(missing)}")
        # Python 3.11.4+ checks each member again ("data": no links out, no odd modes).
        tar.extractall(out, members=wanted, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="llama-cpp-python version (default: the Makefile's pin)")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--force", action="store_true", help="fetch again even if dest is current")
    args = parser.parse_args()
    fetch(args.version, args.dest, args.force)


if __name__ == "__main__":
    main()
