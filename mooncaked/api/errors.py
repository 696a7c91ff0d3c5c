"""The API's error: an OpenAI-style error body with its HTTP status. Its own module so
that protocol.py and structured.py (which protocol.py uses) both import it."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}.

    `status` is the HTTP status (400 bad input, 404 unknown model or route, 413 body
    too large, 500 engine failure, 503 shutting down).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def body(self) -> dict:
        """The JSON error body (OpenAI API reference, "Error codes")."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}} as the OpenAI API answers errors."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


__all__ = ["ApiError", "error_body"]
