"""ParrotServeCore without engines: sessions, expiry, variable binding, global constants, laziness."""

from __future__ import annotations

import asyncio

import pytest

from parrot.errors import NotFoundError
from parrot.protocol import SemanticCallParameter, SemanticCallRequest
from parrot.serve.core import ParrotServeCore
from parrot.serve.session import AuthError, ForbiddenError
from parrot.serve.tokenizers import TokenizerManager
from tests.conftest import tiny_tokenizer


def make_core(**kw) -> ParrotServeCore:
    tokenizers = TokenizerManager()
    tokenizers.register("tiny", tiny_tokenizer())
    return ParrotServeCore(model="tiny", tokenizers=tokenizers, **kw)


def test_sessions_auth_and_expiry() -> None:
    async def run() -> None:
        core = make_core(session_ttl=0.4)
        await core.start()
        try:
            s = core.create_session()
            with pytest.raises(AuthError):
                core.get_session(s.session_id, None)
            with pytest.raises(ForbiddenError):
                core.get_session(s.session_id, "wrong")
            assert core.get_session(s.session_id, s.token) is s
            var = core.create_var(s, "x", None)
            await asyncio.sleep(1.2)
            with pytest.raises(NotFoundError):
                core.get_session(s.session_id, s.token)
            assert var.is_failed and "session ended" in (var.error or "")
        finally:
            await core.stop()

    asyncio.run(run())


def test_leading_text_is_a_global_constant_shared_across_sessions() -> None:
    core = make_core()
    a, b = core.create_session(), core.create_session()
    system = "You are a helpful assistant. " * 4
    req = {"template": system + "Q: {{q}} A: {{a}}", "parameters": [
        SemanticCallParameter(name="q", value="hi"), SemanticCallParameter(name="a", is_output=True)]}
    core.semantic_call(a, SemanticCallRequest(session_id=a.session_id, **req))
    core.semantic_call(b, SemanticCallRequest(session_id=b.session_id, **req))
    const_a = [c for c in a.executor.graph.chains[0].fills if c.var.is_constant or c.var.session_id is None]
    const_b = [c for c in b.executor.graph.chains[0].fills if c.var.is_constant or c.var.session_id is None]
    assert const_a[0].var is const_b[0].var  # one variable, one KV context, for both sessions
    assert const_a[0].var.session_id is None
    # lazy: nothing was scheduled, since nobody read the output and no output_criteria was given
    assert not core.scheduler.queue and not core.scheduler.running


def test_output_criteria_runs_without_a_get() -> None:
    core = make_core()
    s = core.create_session()
    core.semantic_call(s, SemanticCallRequest(session_id=s.session_id, template="Go {{a}}", output_criteria="latency",
                                              parameters=[SemanticCallParameter(name="a", is_output=True)]))
    assert len(core.scheduler.queue) == 1  # no engine yet: queued, with its criterion
    assert core.scheduler.queue[0].criterion == "latency"
