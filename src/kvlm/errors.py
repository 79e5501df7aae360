"""Exceptions for mistakes a user can make.

Everything derived from `KvlmError` is a user-facing condition (a missing file, an
unsupported model, a prompt longer than the cache, a bad argument): the CLI prints its
message as one line and the server turns it into a 4xx body. Anything else is a bug
and is allowed to show its traceback.
"""


class KvlmError(Exception):
    """A user-facing error with a message that stands on its own line."""


class ModelLoadError(KvlmError):
    """The model path is missing, unreadable, truncated or corrupt."""


class UnsupportedModelError(ModelLoadError):
    """The file is readable but describes something kvlm does not run."""


class CacheOverflowError(KvlmError):
    """A write would go past the cache's capacity; nothing was written."""


class InvalidRequestError(KvlmError, ValueError):
    """A generation request with out-of-range or inconsistent parameters. `param` names
    the request field at fault, where there is one (the server's error body carries it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
