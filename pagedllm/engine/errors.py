"""The one error type for a request the engine refuses.

Raised by SamplingParams and the InputProcessor (the edge: every door validates there, once).
It carries what an API needs without reading the message: `param`, the field at fault as the
caller spelled it in Python (`"temperature"`, `"prompt"`, `"max_tokens"`), and `code`, a
machine-readable reason (`"context_length_exceeded"`) or None. The server maps these attributes
to OpenAI's error schema; it never matches message text. A subclass of ValueError, so callers
that catch ValueError keep working.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str | None, str | None]]:
        return (type(self), (self.message, self.param, self.code))  # crosses the core's pipe intact

    def renamed(self, param: str | None) -> InvalidRequestError:
        """The same error naming the field as another door spells it (`max_completion_tokens`)."""
        return type(self)(self.message, param, self.code)
