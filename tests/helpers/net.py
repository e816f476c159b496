"""Loopback ports for tests that start services: a free one, and whether something listens."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing on 127.0.0.1 holds now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether a server accepts connections on 127.0.0.1:`port`."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
