"""A free TCP port for a one-node rendezvous (`zeroio launch`, `zeroio train --nproc 1`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


__all__ = ["free_port"]
