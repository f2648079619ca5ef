"""TCP ports for the servers DART starts on a host (embedded NATS, S3 and PostgreSQL, vLLM servers, VM
containers): asked of the kernel, free when chosen."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", exclude: Sequence[int] = ()) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` right now, none of them in ``exclude``.

    The sockets stay bound until all are chosen: asked one at a time, the kernel can give the same port twice,
    and two servers given one port fail to start.
    """
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
