"""``--log-format json``: every log line one JSON object, for log shippers.

Every object has the same keys first — ``ts`` (UTC, ISO 8601 with milliseconds and ``Z``),
``level`` (lower case), ``logger``, ``message`` — then, for an access line, the request's fields
(:func:`~.record.access_fields`, values typed: numbers as numbers, what did not happen as
``null``, and ``message`` is ``"access"``), and for a logged exception its traceback as
``exception``. Keys are never renamed: new ones may be added.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import orjson

#: The attribute an access line's fields travel in (``logger.log(..., extra={ACCESS: ...})``).
ACCESS = "access"


class JsonLines(logging.Formatter):
    """Formats a record as one JSON object (see the module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        fields: dict[str, Any] | None = getattr(record, ACCESS, None)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": "access" if fields is not None else record.getMessage(),
        }
        if fields is not None:
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()
