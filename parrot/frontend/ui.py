"""The live web view: `/ui` (a page shipped in the package, no CDN) and the JSON behind it.

- `GET /v1/session/{session_id}/graph`: the session's DAG, states, timings, contexts, engines and errors
  (parrot/serve/graph_view.py). Guarded like the rest of the session: its token as
  `Authorization: Bearer <session_token>` or `X-Session-Token`; the server's API key (when it has one)
  as `Authorization: Bearer <api key>` opens every session. Reading the graph does not count as using
  the session (it does not hold off its idle expiry).
- `GET /v1/sessions`: one summary line per live session; only with the API key (404 when the server
  has none: then no one may see every session).
- `GET /ui` and its assets: the page, open without credentials (it holds no data). It reads them from
  the URL fragment, which browsers never send: `/ui#session=<id>&token=<session_token>` for one
  session, `&key=<api key>` added on a server with an API key, `/ui#key=<api key>` for all sessions.
"""

from __future__ import annotations

import hmac
from importlib import resources
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import HTMLResponse, Response

from parrot.errors import NotFoundError
from parrot.frontend.api_keys import client_of
from parrot.serve.core import ParrotServeCore
from parrot.serve.graph_view import session_graph, sessions_view
from parrot.serve.session import AuthError, ForbiddenError, Session

STATIC = resources.files("parrot.frontend").joinpath("static")
_TYPES = {"ui.js": "text/javascript; charset=utf-8", "ui.css": "text/css; charset=utf-8"}
Auth = Annotated[str | None, Header()]
SessionToken = Annotated[str | None, Header(alias="X-Session-Token")]


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _is_admin(token: str | None, api_key: str | None) -> bool:
    return bool(token and api_key and hmac.compare_digest(token.encode(), api_key.encode()))


def ui_routes(core: ParrotServeCore, api_key: str | None = None) -> APIRouter:
    """Routes of the web view. `api_key`: the key that opens every session (`ServeConfig.admin_key`, else its
    one API key); None: each session only with its own token, and no list of sessions."""
    router = APIRouter()

    def viewed_session(session_id: str, authorization: str | None, session_token: str | None,
                       client: int | None) -> Session:
        bearer = _bearer(authorization)
        session = core.sessions.get(session_id)
        if session is not None and _is_admin(bearer, api_key):
            return session
        if session is None or session.owner != client:  # another API key's session: as if absent
            raise NotFoundError(f"session {session_id!r} does not exist")
        last = session.last_access
        session.check_token(session_token or bearer)  # 401 / 403
        session.last_access = last  # watching a session does not keep it alive
        return session

    @router.get("/v1/session/{session_id}/graph")
    async def graph(request: Request, session_id: str, authorization: Auth = None, xst: SessionToken = None) -> dict:
        return session_graph(core, viewed_session(session_id, authorization, xst, client_of(request)))

    @router.get("/v1/sessions")
    async def sessions(authorization: Auth = None) -> dict:
        if api_key is None:
            raise NotFoundError("listing every session needs the server's admin key (parrot serve --admin-key, or "
                                "PARROT_ADMIN_KEY), or its one API key (several API keys are several clients)")
        token = _bearer(authorization)
        if token is None:
            raise AuthError("missing API key: send 'Authorization: Bearer <api key>'")
        if not _is_admin(token, api_key):
            raise ForbiddenError("wrong API key")
        return {"sessions": sessions_view(core)}

    @router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(STATIC.joinpath("ui.html").read_text(encoding="utf-8"),
                            headers={"Cache-Control": "no-cache"})

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in _TYPES:
            raise NotFoundError(f"no such file: /ui/{name}")
        return Response(STATIC.joinpath(name).read_bytes(), media_type=_TYPES[name],
                        headers={"Cache-Control": "no-cache"})

    return router

