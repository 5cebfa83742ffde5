"""Logging for the server and the router: health probes, which the router sends
every few seconds to every worker, are neither logged as they are sent (httpx
logs each request it makes) nor as they are answered (uvicorn's access log)."""

from __future__ import annotations

import logging

PROBED_PATHS = ("/health",)


class QuietProbes(logging.Filter):
    """Drop uvicorn's access-log lines for the probed paths; keep every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?")[0] if len(args) > 2 else ""
        return path not in PROBED_PATHS


def configure(log_level: str) -> None:
    """The format both processes log in, and quiet health probes."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
