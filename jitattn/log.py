"""The ``jitattn`` logger.

The library adds no handler of its own unless the user opts in with
``JITATTN_LOG_LEVEL=info|debug``; then one stderr handler is installed, once,
the first time something logs.
"""

from __future__ import annotations

import logging

from . import env

logger = logging.getLogger("jitattn")
_installed_handler: logging.Handler | None = None


def get_logger() -> logging.Logger:
    """The library logger, with the opt-in stderr handler applied if requested."""
    global _installed_handler
    level = env.log_level()
    if level in ("info", "debug") and _installed_handler is None:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[jitattn %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if level == "debug" else logging.INFO)
        _installed_handler = handler
    return logger
