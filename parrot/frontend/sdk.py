"""The Parrot Python SDK: a client of the REST API (`parrot/frontend/http_api.py`).

A `VirtualMachine` is one session on a Parrot server; a `SemanticVariable` is a future for a value the
server holds (a generation's output, a native transform's output, or a value the app set). Submitting
calls never waits: the server builds the session's data-flow graph and runs it when something is read
(`get`, `aget`, `stream`) or when a call asks for it with `output_criteria`.

This module is a pure client: httpx, pydantic and the stdlib only (no JAX), so `import parrot` stays light.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import os
import ssl
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import httpx

from parrot.errors import ConflictError, InvalidRequestError, NotFoundError, ParrotError, RateLimitError

DEFAULT_URL = "http://127.0.0.1:9000"
Criterion = Literal["latency", "throughput"]
_MAX_POLL = 3600.0  # the server caps one long-poll at this many seconds

_current_vm: contextvars.ContextVar[VirtualMachine | None] = contextvars.ContextVar("parrot_vm", default=None)
# this thread's / task's `activate()`s not undone yet, and what was current before the first of them
_activations: contextvars.ContextVar[tuple[VirtualMachine | None, tuple[VirtualMachine, ...]]] = (
    contextvars.ContextVar("parrot_vm_activations", default=(None, ())))


# ---- errors -------------------------------------------------------------------------------------------
class AuthError(ParrotError):
    """The server refused the session token (HTTP 401: none or malformed; 403: another session's)."""


class VariableFailedError(ParrotError):
    """The variable will never have a value: its generation or transform failed (HTTP 424), or a
    variable it depends on did. The message is the server's reason."""


class VariableTimeoutError(ParrotError, TimeoutError):
    """The variable was not ready within the timeout (HTTP 408). Also a builtin `TimeoutError`."""


class ServerError(ParrotError):
    """The server failed (5xx) or answered something the SDK does not understand."""


_STATUS_ERRORS: dict[int, type[ParrotError]] = {
    400: InvalidRequestError, 401: AuthError, 403: AuthError, 404: NotFoundError, 408: VariableTimeoutError,
    409: ConflictError, 413: InvalidRequestError, 422: InvalidRequestError, 424: VariableFailedError,
}


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
    except (ValueError, json.JSONDecodeError):
        pass
    return response.text.strip() or response.reason_phrase


def _check(response: httpx.Response) -> httpx.Response:
    """Raise the `ParrotError` subclass matching an error status; return the response otherwise."""
    if response.status_code < 400:
        return response
    message = f"{_detail(response)} (HTTP {response.status_code} on {response.request.method} " \
              f"{response.request.url.path})"
    if response.status_code == 429:  # a limit the server was started with: retry after the time it names
        try:
            retry_after = float(response.headers.get("retry-after", "1"))
        except ValueError:
            retry_after = 1.0
        raise RateLimitError(message, retry_after)
    raise _STATUS_ERRORS.get(response.status_code, ServerError)(message)


def _transport_error(url: str, exc: httpx.TransportError) -> ParrotError:
    return ServerError(f"cannot reach the Parrot server at {url}: {type(exc).__name__}: {exc}")


def current_vm() -> VirtualMachine:
    """The `VirtualMachine` of the innermost `with VirtualMachine(...)` block (in this thread / task)."""
    vm = _current_vm.get()
    if vm is None:
        raise ParrotError("no VirtualMachine: call inside `with VirtualMachine(url) as vm:` or pass vm=")
    return vm


# ---- semantic variables -------------------------------------------------------------------------------
class SemanticVariable:
    """A future for one variable of a session. Values are set once, so a value read is cached."""

    def __init__(self, vm: VirtualMachine, var_id: str, name: str) -> None:
        self.vm = vm
        self.id = var_id
        self.name = name
        self._content: str | None = None
        # a typed output's parser (P.Output(schema=...)): get() / aget() return parse(text)
        self.parse: Callable[[str], Any] | None = None

    def __repr__(self) -> str:
        state = "ready" if self._content is not None else "unread"
        return f"SemanticVariable(name={self.name!r}, id={self.id!r}, {state})"

    @property
    def is_ready(self) -> bool:
        """True once this client has read the value (does not ask the server)."""
        return self._content is not None

    def get(self, criteria: Criterion = "latency", timeout: float | None = None) -> Any:
        """The value, waiting for it (a long-poll). Reading a pending variable makes the server run
        everything it depends on, scheduled for `criteria`. `timeout` (seconds) defaults to the VM's;
        `VariableTimeoutError` when it passes, `VariableFailedError` if the value can never come."""
        if self._content is None:
            self._content = self.vm._get_var(self.id, criteria, timeout)
        return self._parsed()

    async def aget(self, criteria: Criterion = "latency", timeout: float | None = None) -> Any:
        """`get` for asyncio: many `aget`s can wait concurrently (e.g. under `asyncio.gather`)."""
        if self._content is None:
            self._content = await self.vm._aget_var(self.id, criteria, timeout)
        return self._parsed()

    @property
    def text(self) -> str | None:
        """The value's text once read (a typed output's JSON text), else None."""
        return self._content

    def _parsed(self) -> Any:
        if self.parse is None:
            return self._content
        try:
            return self.parse(self._content)
        except ValueError as exc:  # pydantic's ValidationError and json's JSONDecodeError are ValueErrors
            raise VariableFailedError(f"semantic variable {self.name!r} ({self.id}) does not parse as its "
                                      f"type: {exc}") from exc

    def stream(self, criteria: Criterion = "latency") -> Iterator[str]:
        """The value's text deltas as they are generated (all of it at once if already set). Their
        concatenation is the value. A failure raises `VariableFailedError` from the iterator."""
        if self._content is not None:
            yield self._content
            return
        parts: list[str] = []
        for delta in self.vm._stream_var(self.id, criteria):
            parts.append(delta)
            yield delta
        self._content = "".join(parts)

    async def astream(self, criteria: Criterion = "latency") -> AsyncIterator[str]:
        """`stream` for asyncio."""
        if self._content is not None:
            yield self._content
            return
        parts: list[str] = []
        async for delta in self.vm._astream_var(self.id, criteria):
            parts.append(delta)
            yield delta
        self._content = "".join(parts)

    def set(self, content: str) -> None:
        """Give a pending variable its value (once; a second set is a `ConflictError`)."""
        self.vm._set_var(self.id, content)
        self._content = content


# ---- the session --------------------------------------------------------------------------------------
@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client of the process. httpx builds one per client by default, loading the
    trust store each time (~35 ms of CPU per client, more on a loaded machine): an app server opening a
    VirtualMachine per user request would pay that on every one. Built on first use, as httpx builds it
    (certifi's store, or SSL_CERT_FILE / SSL_CERT_DIR)."""
    return httpx.create_ssl_context()


class VirtualMachine:
    """One Parrot session. Use as a context manager (`with VirtualMachine(url) as vm:`), which creates
    the session, makes it the current VM for semantic / native functions and deletes it on exit; or
    call `open()` / `close()` (then pass `vm=` to functions, or use `vm.activate()`).

    `timeout` (seconds) bounds each HTTP request and is the default wait of `SemanticVariable.get`;
    None waits without limit. `api_key` (default: $PARROT_API_KEY): the server's API key, sent as
    `Authorization: Bearer`; the session token then travels in `X-Session-Token`. `cache_salt`: the session
    shares global constants and cached prompt prefixes only with sessions of the same salt (a tenant's)."""

    def __init__(self, url: str = DEFAULT_URL, timeout: float | None = 600.0, api_key: str | None = None,
                 cache_salt: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.cache_salt = cache_salt
        self.timeout = timeout
        self.api_key = api_key if api_key is not None else (os.environ.get("PARROT_API_KEY") or None)
        self.session_id: str | None = None
        self._token: str | None = None
        self._client: httpx.Client | None = None
        self._aclients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary())
        self._closing: set[asyncio.Task] = set()  # async clients being closed by a sync close()

    def __repr__(self) -> str:
        return f"VirtualMachine({self.url!r}, session_id={self.session_id!r})"

    # -- lifecycle --
    @property
    def is_open(self) -> bool:
        return self.session_id is not None

    @property
    def ui_url(self) -> str | None:
        """The address of the server's live web view of this session (None until it is open). The
        credentials are in the URL fragment, which browsers never send to the server."""
        if self.session_id is None:
            return None
        return f"{self.url}/ui#session={self.session_id}&token={self._token}"

    def open(self) -> VirtualMachine:
        """Create the session on the server (idempotent)."""
        if self.is_open:
            return self
        # no cap on connections: each thread long-polling a variable holds one (httpx's default 100 made the 101st
        # request wait, then fail as if the server were unreachable)
        client = httpx.Client(base_url=self.url, timeout=self.timeout, headers=self._auth_headers(), verify=_tls(),
                              limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        try:
            body = _check(client.post("/v1/session", json={} if self.cache_salt is None
                                      else {"cache_salt": self.cache_salt})).json()
        except httpx.TransportError as exc:
            client.close()
            raise _transport_error(self.url, exc) from exc
        except BaseException:
            client.close()
            raise
        self.session_id, self._token = body["session_id"], body["session_token"]
        client.headers.update(self._auth_headers())
        self._client = client
        return self

    def _auth_headers(self) -> dict[str, str]:
        """The API key (if any) in Authorization and the session token beside it; without an API key the
        session token is the bearer token."""
        if self.api_key is not None:
            return {"Authorization": f"Bearer {self.api_key}",
                    **({"X-Session-Token": self._token} if self._token else {})}
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def close(self) -> None:
        """Delete the session on the server (its variables and contexts are freed) and close the
        connections. Errors deleting it (server gone, session expired) are ignored."""
        client, self._client = self._client, None
        if client is not None and self.session_id is not None:
            try:
                client.delete(f"/v1/session/{self.session_id}")
            except httpx.HTTPError:
                pass
            client.close()
        self.session_id = None
        self._token = None
        aclients, self._aclients = self._aclients, weakref.WeakKeyDictionary()
        for loop, aclient in list(aclients.items()):  # async clients are bound to their loops: closed there
            if loop.is_closed():
                continue
            if loop.is_running():
                try:
                    running = asyncio.get_running_loop()
                except RuntimeError:
                    running = None
                if running is loop:  # closed once this loop runs again (`await vm.aclose()` closes it at once)
                    self._closing.add(task := loop.create_task(aclient.aclose()))
                    task.add_done_callback(self._closing.discard)
                else:
                    asyncio.run_coroutine_threadsafe(aclient.aclose(), loop)
            else:
                with contextlib.suppress(RuntimeError):  # (another loop runs in this thread: it is left to the GC)
                    loop.run_until_complete(aclient.aclose())

    async def aclose(self) -> None:
        """Close the async client of the running loop, then the session (as `close`)."""
        loop = asyncio.get_running_loop()
        aclient = self._aclients.pop(loop, None)
        if aclient is not None:
            await aclient.aclose()
        self.close()

    def activate(self) -> contextvars.Token:
        """Make this the current VM (what `with` does) in this thread or task; `deactivate()` there undoes the
        latest. Each thread and task keeps its own activations (a VM shared by several is activated in each)."""
        base, active = _activations.get()
        if not active:
            base = _current_vm.get()
        _activations.set((base, (*active, self)))
        return _current_vm.set(self)

    def deactivate(self) -> None:
        """Undo this VM's latest `activate()` in this thread or task (nothing if none is left there); the latest
        activation left is current then, or, with none, what was before the first."""
        base, active = _activations.get()
        i = next((i for i in range(len(active) - 1, -1, -1) if active[i] is self), None)
        if i is None:
            return
        rest = active[:i] + active[i + 1:]
        _activations.set((base, rest))
        _current_vm.set(rest[-1] if rest else base)

    def __enter__(self) -> VirtualMachine:
        self.open()
        self.activate()
        return self

    def __exit__(self, *exc: object) -> None:
        self.deactivate()
        self.close()

    async def __aenter__(self) -> VirtualMachine:
        await asyncio.to_thread(self.open)
        self.activate()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.deactivate()
        await self.aclose()

    # -- transport --
    def _sync(self) -> httpx.Client:
        if self._client is None:
            raise ParrotError("the VirtualMachine is not open: use `with VirtualMachine(url) as vm:` or vm.open()")
        return self._client

    def _async(self) -> httpx.AsyncClient:
        self._sync()
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = httpx.AsyncClient(base_url=self.url, timeout=self.timeout,
                                       headers=self._auth_headers(), verify=_tls(),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            self._aclients[loop] = client
        return client

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        if "json" in kw:  # escaped to ASCII: a lone surrogate (a file name read with surrogateescape, say) is sent
            # as "\udcff", which the server reads as U+FFFD, where httpx's UTF-8 encoding of the body would raise
            kw["content"] = json.dumps(kw.pop("json")).encode()
            kw["headers"] = {**kw.get("headers", {}), "Content-Type": "application/json"}
        try:
            response = self._sync().request(method, path, **kw)
        except httpx.TransportError as exc:
            raise _transport_error(self.url, exc) from exc
        _check(response)
        return response.json() if response.content else None

    def _wait_plan(self, timeout: float | None) -> tuple[float | None, float | None, httpx.Timeout]:
        """(total wait, one long-poll's wait, the HTTP timeouts for it). Waits over the server's cap of
        one long-poll are done as several."""
        wait = self.timeout if timeout is None else timeout
        poll = None if wait is None else min(wait, _MAX_POLL)
        read = None if poll is None else poll + 30.0  # the server answers 408 at `poll`; allow for slack
        return wait, poll, httpx.Timeout(self.timeout, read=read)

    def _get_params(self, criteria: Criterion, poll: float | None) -> dict[str, Any]:
        params: dict[str, Any] = {"session_id": self.session_id, "criteria": criteria}
        if poll is not None:
            params["timeout"] = poll
        return params

    def _get_var(self, var_id: str, criteria: Criterion, timeout: float | None) -> str:
        remaining, poll, http_timeout = self._wait_plan(timeout)
        client = self._client
        while True:
            try:
                return self._request("GET", f"/v1/semantic_var/{var_id}", params=self._get_params(criteria, poll),
                                     timeout=http_timeout)["content"]
            except ServerError:
                if self._client is not client:  # closed while waiting (its socket gone): as the server ends it
                    raise VariableFailedError(f"variable {var_id}: session ended (the VirtualMachine was closed "
                                              "while waiting)") from None
                raise
            except VariableTimeoutError:
                if remaining is None or remaining <= _MAX_POLL:
                    raise
                remaining -= _MAX_POLL
                poll = min(remaining, _MAX_POLL)

    async def _aget_var(self, var_id: str, criteria: Criterion, timeout: float | None) -> str:
        remaining, poll, http_timeout = self._wait_plan(timeout)
        client = self._async()
        while True:
            try:
                response = await client.get(f"/v1/semantic_var/{var_id}", params=self._get_params(criteria, poll),
                                            timeout=http_timeout)
            except httpx.TransportError as exc:
                raise _transport_error(self.url, exc) from exc
            try:
                return _check(response).json()["content"]
            except VariableTimeoutError:
                if remaining is None or remaining <= _MAX_POLL:
                    raise
                remaining -= _MAX_POLL
                poll = min(remaining, _MAX_POLL)

    def _stream_var(self, var_id: str, criteria: Criterion) -> Iterator[str]:
        params = {"session_id": self.session_id, "criteria": criteria}
        parser = _VarStream(var_id)
        try:
            with self._sync().stream("GET", f"/v1/semantic_var/{var_id}/stream", params=params,
                                     timeout=httpx.Timeout(self.timeout, read=None)) as response:
                if response.status_code >= 400:
                    response.read()
                    _check(response)
                for line in response.iter_lines():
                    delta = parser.feed(line)
                    if parser.done:
                        return
                    if delta:
                        yield delta
        except httpx.TransportError as exc:
            raise _transport_error(self.url, exc) from exc
        parser.ended()

    async def _astream_var(self, var_id: str, criteria: Criterion) -> AsyncIterator[str]:
        params = {"session_id": self.session_id, "criteria": criteria}
        parser = _VarStream(var_id)
        try:
            async with self._async().stream("GET", f"/v1/semantic_var/{var_id}/stream", params=params,
                                            timeout=httpx.Timeout(self.timeout, read=None)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _check(response)
                async for line in response.aiter_lines():
                    delta = parser.feed(line)
                    if parser.done:
                        return
                    if delta:
                        yield delta
        except httpx.TransportError as exc:
            raise _transport_error(self.url, exc) from exc
        parser.ended()

    def _set_var(self, var_id: str, content: str) -> None:
        self._request("POST", f"/v1/semantic_var/{var_id}", json={"session_id": self.session_id, "content": content})

    # -- public API --
    def variable(self, name: str = "var", content: str | None = None) -> SemanticVariable:
        """A new variable of this session: set now if `content` is given, else pending until `set`
        (or until a call that outputs to it generates it)."""
        body = self._request("POST", "/v1/semantic_var",
                             json={"session_id": self.session_id, "name": name, "content": content})
        var = SemanticVariable(self, body["var_id"], name)
        var._content = content
        return var

    def semantic_call(self, template: str, parameters: Sequence[Mapping[str, Any]],
                      output_criteria: Criterion | None = None,
                      models: list[str] | None = None) -> dict[str, SemanticVariable]:
        """The raw `POST /v1/semantic_call`: `parameters` as the API takes them. Returns every bound
        parameter's variable by name (inputs included). Prefer `@semantic_function`."""
        body: dict[str, Any] = {"session_id": self.session_id, "template": template, "parameters": list(parameters)}
        if output_criteria is not None:
            body["output_criteria"] = output_criteria
        if models is not None:
            body["models"] = models
        created = self._request("POST", "/v1/semantic_call", json=body)
        return {p["name"]: SemanticVariable(self, p["var_id"], p["name"]) for p in created["param_info"]}

    def native_call(self, transform: str, params: Mapping[str, Any] | None,
                    inputs: Mapping[str, str | SemanticVariable],
                    outputs: Sequence[str]) -> dict[str, SemanticVariable]:
        """The raw `POST /v1/native_call`. Returns the output variables by name. Prefer `transform()`."""
        bound: dict[str, dict[str, str]] = {}
        for name, value in inputs.items():
            bound[name] = self._bind(name, value)
        created = self._request("POST", "/v1/native_call", json={
            "session_id": self.session_id, "transform": transform, "params": dict(params or {}),
            "inputs": bound, "outputs": list(outputs)})
        return {p["name"]: SemanticVariable(self, p["var_id"], p["name"]) for p in created["param_info"]
                if p["is_output"]}

    def transform(self, name: str, params: Mapping[str, Any] | None = None, /, *,
                  outputs: Sequence[str] | None = None,
                  **inputs: str | SemanticVariable) -> SemanticVariable | tuple[SemanticVariable, ...]:
        """Run a server-side string transform (docs/native-functions.md) as a node of the graph, e.g.
        `vm.transform("upper", text=var)` or `vm.transform("join", {"sep": "\\n"}, a=x, b=y)`. Inputs are
        values or variables, in the order given; single-input transforms take `text`. `outputs` defaults
        to `["output"]`. Returns the output variable, or a tuple of them for several outputs."""
        names = list(outputs) if outputs is not None else ["output"]
        out = self.native_call(name, params, inputs, names)
        result = tuple(out[n] for n in names)
        return result[0] if len(result) == 1 else result

    def inspect(self) -> dict:
        """The server's view of the session (`GET /v1/session/{id}`): variables with their states, requests."""
        return self._request("GET", f"/v1/session/{self.session_id}")

    def _bind(self, name: str, value: object) -> dict[str, str]:
        """An input binding: a variable of this session by id, a string by value."""
        if isinstance(value, SemanticVariable):
            if value.vm is not self:
                raise InvalidRequestError(f"input {name!r}: variable {value.id} belongs to another VirtualMachine")
            return {"var_id": value.id}
        if isinstance(value, str):
            return {"value": value}
        raise TypeError(f"input {name!r} must be a str or a SemanticVariable, got {type(value).__name__}")


class _VarStream:
    """Parses a variable stream's Server-Sent Events line by line: text deltas, `[DONE]`, errors."""

    def __init__(self, var_id: str) -> None:
        self.var_id = var_id
        self.event: str | None = None
        self.done = False

    def feed(self, line: str) -> str | None:
        """One line -> a text delta (or None); sets `done` at [DONE]; an error event raises."""
        if line.startswith("event:"):
            self.event = line[6:].strip()
            return None
        if not line.startswith("data:"):
            return None
        data, event, self.event = line[5:].strip(), self.event, None
        if data == "[DONE]":
            self.done = True
            return None
        if event == "error":
            try:
                detail = json.loads(data).get("detail", data)
            except (ValueError, AttributeError):
                detail = data
            raise VariableFailedError(str(detail))
        return json.loads(data)["text"]

    def ended(self) -> None:
        """The connection closed without [DONE]."""
        raise ServerError(f"the stream of {self.var_id} ended without [DONE]")
