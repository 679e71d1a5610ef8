"""Where a process on this machine reaches a server listening on a given host and port."""

from __future__ import annotations

LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # a wildcard bind, reached on loopback


def local_url(host: str, port: int) -> str:
    """http://HOST:PORT for a server listening on host:port: a wildcard address is reached on loopback (of its
    family), an IPv6 address in brackets."""
    host = LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
