"""Request bodies whose text is Unicode: a lone UTF-16 surrogate becomes U+FFFD where a body is read.

JSON may carry a `"\\ud800"` escape with no partner; Python decodes it to a string holding a lone surrogate,
which no UTF-8 encoder takes. Left in, it reached every place that writes text back (an echoed prompt, a
Response's `instructions`, a stop string sent on to an engine process, a variable's value) as a 500 or a
stream cut in the middle. `TextBodyRoute` reads a route's JSON body with each one replaced by U+FFFD (one
character for one, as the tokenizer reads them anyway: `parrot.engine.tokenizer.encodable`), so the server
only ever holds text it can write.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from parrot.engine.tokenizer import encodable

# a surrogate reaches a parsed body only through a \u escape (UTF-8 has no bytes for one): bodies without one are
# taken as parsed, not walked
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def unicode_only(value: Any) -> Any:
    """`value` (parsed JSON) with every string, keys included, free of lone surrogates."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, list):
        return [unicode_only(v) for v in value]
    if isinstance(value, dict):
        return {unicode_only(k): unicode_only(v) for k, v in value.items()}
    return value


class _TextBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            parsed = json.loads(body)
            self._json = unicode_only(parsed) if _ESCAPE.search(body) else parsed
        return self._json


class TextBodyRoute(APIRoute):
    """A route whose JSON body is read with `unicode_only`."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_TextBodyRequest(request.scope, request.receive))

        return route
