"""The floating-point dtypes kiln computes in, by the names configs and flags use."""
from __future__ import annotations

import torch

from kiln.errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPES)}") from None
