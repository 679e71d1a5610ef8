"""API keys as clients: a request's key (one of `ServeConfig.api_keys`) names whose request it is.

The guard (`http_api._Guard`) matches the bearer token against every key in constant time and puts the
matching key's index in the request's ASGI scope under `CLIENT_SCOPE_KEY`; the routes read it (`client_of`)
to open a session only for the key that created it.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

__all__ = ["CLIENT_SCOPE_KEY", "client_of", "key_index"]

CLIENT_SCOPE_KEY = "parrot.client"  # the scope's entry: the index of the API key a request came with


def key_index(token: str | None, keys: tuple[str, ...]) -> int | None:
    """The index of `token` among `keys` (each compared in constant time, all of them), None where it is none."""
    found = None
    for i, key in enumerate(keys):
        if token is not None and hmac.compare_digest(token.encode(), key.encode()) and found is None:
            found = i
    return found


def client_of(request: Request) -> int | None:
    """The API key (its index) the request came with; None where the server takes no key (or not a client's)."""
    return request.scope.get(CLIENT_SCOPE_KEY)
