"""The ``tensordepot`` command: ``serve`` (the broker) and the client
commands ``ls``, ``stat``, ``rm``, ``wait``, ``load``, ``save`` and ``push``.

The one package that may import both ``tensordepot.client`` and
``tensordepot.service``; neither imports it.  Each command loads only what it
uses: the client commands never import FastAPI, uvicorn or the broker.
"""

from ._commands import format_size as format_size
from ._main import build_parser as build_parser
from ._main import main as main

__all__ = ["build_parser", "format_size", "main"]
