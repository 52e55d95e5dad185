"""Errors kiln raises for bad input.

Every error names the file, key or field at fault and what was expected. The CLI turns a
:class:`KilnError` into a one-line message and exit code 2; the runtime answers the one
request at fault and keeps serving the others.
"""


def preview(names: list[str], limit: int = 8) -> str:
    """The first ``limit`` of ``names`` for an error message, with ``...`` if there are more."""
    return f"{names[:limit]}{'...' if len(names) > limit else ''}"


class KilnError(Exception):
    """Base class of every error caused by input kiln was given."""


class ConfigError(KilnError):
    """A config file or config field is missing, malformed or out of range."""


class CheckpointError(KilnError):
    """A weights file is unreadable, or a tensor is missing, unexpected or misshapen."""


class BuildError(KilnError):
    """A checkpoint cannot be built with the requested limits."""


class RequestError(KilnError):
    """A generation request is invalid (a prompt too long, a parameter out of range...)."""


class CapacityError(KilnError):
    """The KV cache has no room left for the work asked of it."""


class QueueFullError(KilnError):
    """The executor's queue of requests waiting for admission is full: worth trying again soon."""


class WorldError(RuntimeError):
    """A rank of a multi-process world died or stopped answering: the world cannot go on (not
    an input error; every rank's next collective fails with it)."""
