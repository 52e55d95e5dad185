"""A user's text files: JSONL records and plain texts, with errors that name the flag, file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from kiln.errors import ConfigError


def jsonl_records(path: Path, flag: str) -> Iterator[tuple[int, object]]:
    """``(line number, parsed value)`` of each non-blank line of a JSONL file; a line that is
    not JSON is a ConfigError naming ``flag``, the file and the line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} {path} line {number}: not JSON ({e.msg})") from None


def read_texts(path: Path, flag: str, limit: int | None = None) -> list[str]:
    """The texts of a user's file named by ``flag``: a ``.jsonl`` of ``{"text"}`` records (the
    first ``limit``), any other file as one text. Errors name the flag, file and line."""
    if path.suffix != ".jsonl":
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise ConfigError(f"{flag} {path}: the file is empty")
        return [text]
    texts = []
    for number, record in jsonl_records(path, flag):
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text:
            raise ConfigError(f"{flag} {path} line {number}: expected an object with a non-empty string \"text\"")
        texts.append(text)
        if len(texts) == limit:
            break
    if not texts:
        raise ConfigError(f"{flag} {path}: no records")
    return texts
