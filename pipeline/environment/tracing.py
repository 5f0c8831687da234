"""MLflow spans of environment requests, holding only sanitised text.

`request_span(inputs)` opens an MLflow span (`environment.reply`, type CHAT_MODEL) whose inputs are the
request passed through `sanitize.sanitize_value`; the caller sets sanitised outputs the same way. An
exception raised inside the span is recorded as its sanitised message: MLflow's own handler would record
the raw one, which can quote the server's reply body. Without MLflow installed the span is a null context.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from pipeline.environment.sanitize import sanitize_text, sanitize_value


def request_span(inputs: dict[str, Any]) -> Any:
    """A context manager yielding the MLflow span of one request (or None without MLflow)."""
    try:
        import mlflow
    except ImportError:
        return nullcontext(None)
    return _SpanInputs(mlflow.start_span(name="environment.reply", span_type="CHAT_MODEL"), sanitize_value(inputs))


class _SpanInputs:
    """Enter an MLflow span context, record the request as its inputs and an exception only sanitised."""

    def __init__(self, span_cm: Any, inputs: dict[str, Any]) -> None:
        self._cm, self._inputs = span_cm, inputs

    def __enter__(self) -> Any:
        self._span = self._cm.__enter__()
        self._span.set_inputs(self._inputs)
        return self._span

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is not None:  # MLflow would record the raw message, which can quote the server's body
            self._span.record_exception(sanitize_text(f"{exc_type.__name__}: {exc}"))
        self._cm.__exit__(None, None, None)
        return False
