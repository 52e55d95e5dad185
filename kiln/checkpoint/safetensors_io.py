"""safetensors files read and written one tensor at a time, with plain file reads and writes.

The safetensors package memory-maps a file: every page a conversion touches then counts in the
process's resident memory until the map closes, so converting a 16 GB model held ~16 GB. These
read a tensor (or the rows of one a rank needs) into memory the caller owns, and write a file
whose header is laid out first from the tensors' names, dtypes and shapes, each tensor then
written at its offset as it is made. The files are ordinary safetensors files (the format: an
8-byte little-endian header length, a JSON header of ``{name: {dtype, shape, data_offsets}}`` and
``__metadata__``, then the data).
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from kiln.errors import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIGN = 64  # the data starts on a cache line (safetensors' own writer aligns it to 8)


class SafetensorsReader:
    """The tensors of one safetensors file, read on demand (``read``) without a memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")
            (length,) = struct.unpack("<Q", self._file.read(8))
            header = json.loads(self._file.read(length))
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: no such file") from None
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + length
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, entry in header.items():
            try:
                dtype, (start, end) = DTYPES[entry["dtype"]], entry["data_offsets"]
                self._entries[name] = (dtype, tuple(int(d) for d in entry["shape"]), int(start), int(end))
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: not a readable safetensors file (tensor {name!r} has the "
                                      f"header entry {entry})") from None
        end = max((e for *_, e in self._entries.values()), default=0)
        if self._base + end > self.path.stat().st_size:
            raise CheckpointError(f"{self.path}: not a readable safetensors file (truncated: the header names "
                                  f"{self._base + end} bytes, the file has {self.path.stat().st_size})")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return self._entries[key][0]

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        """Tensor ``key``, or the part ``index`` selects (a leading row range is read alone)."""
        dtype, shape, start, end = self._entries[key]
        rows = _leading_rows(index, shape)
        if rows is not None:  # only those rows' bytes
            row_bytes = (end - start) // shape[0] if shape[0] else 0
            first, stop = rows
            out = self._read_bytes(start + first * row_bytes, (stop - first) * row_bytes)
            return out.view(dtype).reshape(stop - first, *shape[1:])
        whole = self._read_bytes(start, end - start).view(dtype).reshape(shape)
        return whole if index is None else whole[index].clone()

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """Read tensor ``key`` straight into ``out`` (contiguous, of its dtype and size): one copy,
        from the file into memory the caller placed (huge pages, say)."""
        dtype, shape, start, end = self._entries[key]
        if out.dtype != dtype or out.numel() != torch.Size(shape).numel() or not out.is_contiguous():
            raise CheckpointError(f"{self.path}: {key!r} is {dtype} {list(shape)}, not {out.dtype} {list(out.shape)}")
        self._read_at(start, out.view(-1).view(torch.uint8))
        return out.view(shape)

    def mapped(self) -> dict[str, torch.Tensor]:
        """Every tensor as a view of the file mapped copy-on-write: nothing is read until touched,
        the pages are the page cache's own (shared with other processes mapping the file, as
        llama.cpp maps a GGUF), and a tensor written in place copies only the pages it writes.
        A tensor whose offset does not suit its dtype (no kiln file has one) is read instead."""
        if not self._entries:  # nothing to map (and an empty mapping is an error)
            return {}
        mapping = mmap.mmap(self._file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mapping.madvise(mmap.MADV_WILLNEED)  # start reading a cold file ahead of the first token
        whole = torch.frombuffer(mapping, dtype=torch.uint8)  # its storage keeps the mapping open
        out = {}
        for name, (dtype, shape, start, end) in self._entries.items():
            at = self._base + start
            out[name] = whole[at:self._base + end].view(dtype).view(shape) if at % dtype.itemsize == 0 \
                else self.read(name)
        return out

    def _read_bytes(self, offset: int, size: int) -> torch.Tensor:
        return self._read_at(offset, torch.empty(size, dtype=torch.uint8))

    def _read_at(self, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Fill the bytes ``out`` (uint8) from the data section at ``offset``."""
        if out.numel():
            self._file.seek(self._base + offset)
            if self._file.readinto(out.numpy()) != out.numel():
                raise CheckpointError(f"{self.path}: truncated (a tensor's bytes end past the file)")
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _leading_rows(index: tuple | None, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(start, stop)`` when ``index`` selects a contiguous range of the first dimension only."""
    if not index or not shape or not isinstance(index[0], slice) or index[0].step not in (None, 1):
        return None
    if any(s != slice(None) for s in index[1:]):
        return None
    start, stop, _ = index[0].indices(shape[0])
    return start, max(start, stop)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class SafetensorsWriter:
    """A safetensors file written tensor by tensor: ``entries`` (name -> (dtype, shape)) fix the
    header up front; ``write`` puts each tensor at its place; ``close`` checks every one came."""

    def __init__(self, path: str | Path, entries: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": metadata} if metadata else {}
        self._places: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        offset = 0
        # Tensors of whole cache lines first, so each of them starts on one (``mapped`` views).
        for name in sorted(entries, key=lambda n: (_nbytes(*entries[n]) % _ALIGN != 0, n)):
            dtype, shape = entries[name]
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._places[name] = (dtype, tuple(shape), offset, size)
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-(8 + len(encoded)) % _ALIGN)
        self._base = 8 + len(encoded)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)
        self._file.truncate(self._base + offset)
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._places:
            raise CheckpointError(f"{self.path}: {name!r} is not one of the tensors this file was laid out for")
        dtype, shape, offset, size = self._places[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(f"{self.path}: {name!r} is {tensor.dtype} {list(tensor.shape)}, laid out as "
                                  f"{dtype} {list(shape)}")
        if size:
            self._file.seek(self._base + offset)
            self._file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._written.add(name)

    def close(self) -> None:
        self._file.close()
        missing = sorted(set(self._places) - self._written)
        if missing:
            raise CheckpointError(f"{self.path}: tensors never written: {missing[:5]}")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()  # checks that every tensor came
        else:
            self._file.close()  # the caller's atomic output directory goes away with it
