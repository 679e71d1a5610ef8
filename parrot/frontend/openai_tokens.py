"""vLLM's token utility routes beside the OpenAI API: `POST /tokenize` and `POST /detokenize` (also under
`/v1/`), in vLLM's request and answer shapes.

- `/tokenize` takes a `prompt` (text) or chat `messages` (with `tools` / `tool_choice`, or the legacy
  `functions` / `function_call`) and answers `{"count", "max_model_len", "tokens", "token_strs"}`
  (`token_strs`, the vocabulary's token strings, with `return_token_strs: true`, else null). The ids are
  those the completion routes compute for the same input (`usage.prompt_tokens` counts them): text goes
  through `ParrotServeCore.prompt_tokens`, and messages are rendered by the same helpers, in the same
  order, as `/v1/chat/completions` renders them (`chat_pieces`; the forced opening of a tool call that
  `tool_choice` "required" or a named tool appends after the generation prompt included).
  `add_special_tokens` false leaves out the BOS token the tokenizer would add (left out, or true: as the
  completion routes tokenize); `add_generation_prompt` (default true) is the chat template's.
- `/detokenize` takes `tokens` and answers `{"prompt": text}`, special tokens kept (as `echo` shows a
  token-id prompt).

`model` is accepted under any name, as on the completion routes. Errors come in the OpenAI shape
(`openai_errors.OpenAIRoute`): ids outside the vocabulary, both or neither of `prompt` and `messages`,
chat fields beside a `prompt`, and malformed bodies are 400s naming the parameter; what the chat route
refuses (vLLM's `continue_final_message`, a request's own `chat_template`...) is refused here too.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, Strict

from parrot.frontend.openai_api import chat_input, check_forced_call, rendered_pieces
from parrot.frontend.openai_errors import OpenAIError, OpenAIRoute
from parrot.frontend.openai_requests import ChatTemplateOptions, refuse_extensions
from parrot.frontend.openai_tools import forced_prefix
from parrot.serve.core import ParrotServeCore

__all__ = ["TOKEN_PATHS", "DetokenizeRequest", "TokenizeRequest", "token_routes"]

TOKEN_PATHS = ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")
# vLLM's tokenize fields this server does not implement (as /v1/chat/completions refuses them)
_REFUSED = ("chat_template", "documents", "mm_processor_kwargs", "lora_request")
_CHAT_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools", "tool_choice",
                "functions", "function_call")


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt` or `messages`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    def check(self) -> None:
        refuse_extensions(self.model_extra, _REFUSED)
        given = self.model_fields_set
        if self.prompt is None and self.messages is None:
            raise OpenAIError(400, "give a prompt (text) or messages (a chat)", param="prompt")
        if self.prompt is not None and self.messages is not None:
            raise OpenAIError(400, "give a prompt or messages, not both", param="messages")
        if self.prompt is not None:
            for name in _CHAT_FIELDS:
                if name in given and getattr(self, name) is not None:
                    raise OpenAIError(400, f"{name} is a chat field: give it with messages, not with a prompt",
                                      param=name)
        self.check_template_options()


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Annotated[int, Strict()]]


def token_routes(core: ParrotServeCore) -> APIRouter:
    """`/tokenize` and `/detokenize`, each also under `/v1/`, with the OpenAI API's error shape."""
    router = APIRouter(route_class=OpenAIRoute, tags=["tokens"])

    def ids_of(pieces: list[str], add_special_tokens: bool | None) -> list[int]:
        """The pieces' token ids as the completion routes tokenize a prompt (`prompt_tokens`: the pieces
        tokenized together). That refuses an empty prompt, which /tokenize counts, as vLLM does; it
        and add_special_tokens false take the same tokenizer call (`encode_pieces`) directly."""
        if add_special_tokens is False or not "".join(pieces):
            ids = core.tokenizers.encode_pieces(core.model, pieces, add_bos=False if add_special_tokens is False
                                                else None)
        else:
            ids = core.prompt_tokens(pieces)
        return [t for piece in ids for t in piece]

    def chat_text(body: TokenizeRequest) -> list[str]:
        """The chat prompt's pieces, built as `/v1/chat/completions` builds them."""
        tok = core.tokenizers.get(core.model)
        _, choice, render, msgs = chat_input(tok, body.messages, body.tools, body.tool_choice, body.functions,
                                             body.function_call, body.chat_template_kwargs)
        check_forced_call(choice, body.add_generation_prompt)
        pieces, _ = rendered_pieces(render, msgs, body.add_generation_prompt, body.continue_final_message)
        if not body.add_generation_prompt:
            return pieces
        return [*pieces[:-1], pieces[-1] + forced_prefix(choice)]  # "" unless tool_choice forces a call

    # plain functions: FastAPI runs them on its thread pool, so a long text does not hold up the event loop
    def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        body.check()
        if body.messages is not None:
            pieces = chat_text(body)
        else:
            pieces = [body.prompt or ""]
        ids = ids_of(pieces, body.add_special_tokens)
        strs = None
        if body.return_token_strs:
            vocab = core.tokenizers.get(core.model).backend
            strs = [vocab.id_to_token(t) for t in ids]
        return {"count": len(ids), "max_model_len": core.engines.max_sequence_len(live_only=False), "tokens": ids,
                "token_strs": strs}

    def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        vocab = core.tokenizers.get(core.model).backend.get_vocab_size()
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"token ids {bad[:5]} are outside the vocabulary (ids 0 to {vocab - 1})",
                              param="tokens")
        return {"prompt": core.tokenizers.decode(core.model, body.tokens, skip_special_tokens=False)}

    for prefix in ("", "/v1"):
        router.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        router.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])
    return router
