"""The server a client command talks to (``gaggle batch``, ``gaggle bench``): ``--base-url`` with or without
``/v1`` (the form the OpenAI SDK takes and ``gaggle up`` prints, or the bare server), else ``$OPENAI_BASE_URL``
as the SDK reads it, else the local default."""

from __future__ import annotations

import argparse
import os

DEFAULT_SERVER = "http://127.0.0.1:8000"


def server_root(url: str | None = None) -> str:
    """The server's root URL, without a trailing ``/`` or ``/v1``."""
    url = (url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_SERVER).strip().rstrip("/")
    return url.removesuffix("/v1").rstrip("/")


def add_base_url_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    default = server_root()
    parser.add_argument("--base-url", type=server_root, default=default,
                        help=f"the server, with or without /v1 (default: $OPENAI_BASE_URL, else {DEFAULT_SERVER}; "
                             f"here: {default})")
