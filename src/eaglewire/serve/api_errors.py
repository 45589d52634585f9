"""Errors as OpenAI's API sends them: every error is ``{"error": {"message", "type", "param", "code"}}``
with ``param`` naming the offending field (``messages[0].role``), ``code`` null or a string such as
``context_length_exceeded`` (OpenAI's error object), and a message that says what would be right.
"""

from __future__ import annotations

from pydantic import BaseModel


class ErrorObject(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None  # as OpenAI's: null or a string token ("context_length_exceeded"), never a number


class ErrorResponse(BaseModel):
    error: ErrorObject


class APIError(Exception):
    """An error the client caused (or must be told about), sent as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorObject(message=message, type=type, param=param, code=code)).model_dump()
