"""Every error the router answers with, one constructor per kind, all in the OpenAI shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": <http status>}}`` — the same
shape vLLM uses, so clients handle a router error and an engine error alike. Before the first
response byte an error is a JSON response with :attr:`RouterError.status`; after it, the same
object travels as an SSE event (:func:`trio_pdrouter.http.sse.error_event`).

Nothing internal reaches a client: an upstream's failure says which stage failed and how, never
the upstream's address or the exception; the request's answer adds its request id
(:meth:`RouterError.for_request`), and the router's log keeps the detail.
"""

from __future__ import annotations

import attrs
import orjson


@attrs.frozen
class RouterError:
    status: int
    message: str
    type: str
    param: str | None = None
    #: Seconds for a ``Retry-After`` header (every 429 the router produces has one, and the
    #: 503 of a shutdown).
    retry_after: int | None = None

    def for_request(self, request_id: str) -> RouterError:
        """The same error naming the request (so a client can quote it to the operator)."""
        return attrs.evolve(self, message=f"{self.message} (request id {request_id})")

    def payload(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.payload())


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param)


def unauthorized(message: str = "missing or invalid API key") -> RouterError:
    return RouterError(401, message, "authentication_error")


def forbidden(message: str) -> RouterError:
    return RouterError(403, message, "permission_error")


def not_found(path: str) -> RouterError:
    return RouterError(404, f"no route for {path}", "not_found_error")


def model_not_found(model: str) -> RouterError:
    """vLLM's answer for a model it does not serve (``_check_model`` in
    vllm/entrypoints/openai/serving_engine.py, commit 0030b9ffce2b2e8b8e9f04a7b108f5877193cec0):
    404, ``NotFoundError``; ``param`` names the field, as the simulator's does."""
    return RouterError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def method_not_allowed(method: str, path: str) -> RouterError:
    return RouterError(405, f"method {method} is not allowed on {path}", "invalid_request_error")


def queue_timeout(seconds: float) -> RouterError:
    return RouterError(408, f"request waited {seconds:g}s in the admission queue", "timeout_error")


def body_timeout(seconds: float) -> RouterError:
    return RouterError(408, f"request body did not arrive within {seconds:g}s", "timeout_error")


def headers_too_large(limit: int) -> RouterError:
    return RouterError(
        431, f"request line and headers exceed {limit} bytes", "invalid_request_error"
    )


def http2_not_served() -> RouterError:
    return RouterError(505, "HTTP/2 is not served; use HTTP/1.1", "invalid_request_error")


def payload_too_large(limit: int) -> RouterError:
    return RouterError(413, f"request body exceeds {limit} bytes", "invalid_request_error")


def unsupported_media_type(content_type: str) -> RouterError:
    return RouterError(
        415,
        f"Content-Type must be application/json, got {content_type or 'nothing'!r}",
        "invalid_request_error",
    )


def too_many_requests(
    message: str = "the router's admission queue is full", retry_after: int = 1
) -> RouterError:
    return RouterError(429, message, "rate_limit_error", retry_after=max(1, retry_after))


def internal(message: str) -> RouterError:
    return RouterError(500, message, "internal_error")


def upstream_failed(stage: str, what: str) -> RouterError:
    """An upstream leg failed; ``what`` says how in words that name no address (the log has
    the detail)."""
    return RouterError(502, f"the {stage} upstream {what}", "upstream_error")


def no_healthy_endpoint(stage: str) -> RouterError:
    return RouterError(503, f"no healthy {stage} endpoint is available", "service_unavailable")


def shutting_down() -> RouterError:
    return RouterError(503, "the router is shutting down", "service_unavailable", retry_after=1)


def upstream_timeout(stage: str) -> RouterError:
    return RouterError(504, f"the {stage} upstream timed out", "timeout_error")
