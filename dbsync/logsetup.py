"""The ``dbsync`` logger's stderr handler, shared by the command line (``--log-level``) and
vLLM's processes (``vllm.plugin.configure_logging``). Imports nothing heavy: the command line
starts without torch."""

from __future__ import annotations

import logging

#: each line says it is dbsync's, its level and when
LINE_FORMAT = "(dbsync) %(levelname)s %(asctime)s %(message)s"


def add_stderr_handler() -> bool:
    """Give the ``dbsync`` logger a stderr handler (lines in ``LINE_FORMAT``, not passed on
    to the root logger), unless it has a handler already. Returns whether one was added."""
    logger = logging.getLogger("dbsync")
    if logger.handlers:
        return False
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LINE_FORMAT, datefmt="%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
    return True
