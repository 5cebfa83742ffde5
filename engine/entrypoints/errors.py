"""Errors in the shape OpenAI's API gives them, so that its clients raise the
right exception with the server's message:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}
"""

from __future__ import annotations

from starlette.responses import JSONResponse

# The `type` OpenAI gives each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "internal_server_error",  # the router's: a worker failed
    503: "service_unavailable_error",
    504: "timeout_error",  # the router's: no worker answered in time
}


class OpenAIError(Exception):
    """An error the server answers with, as OpenAI would."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.request_id = request_id

    def body(self) -> dict:
        error = {
            "message": self.message,
            "type": ERROR_TYPES.get(self.status, "error"),
            "param": self.param,
            "code": self.code,
        }
        if self.request_id is not None:
            error["request_id"] = self.request_id
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param, code)
