"""OpenAI request bodies and their translation into the engine's `SamplingParams`.

Every documented parameter of `/v1/completions` and `/v1/chat/completions` is either honoured or refused
with a 400 naming it; see docs/openai-api.md for the table. Extensions other servers' users send (in the
openai client's `extra_body`) are honoured under the names vLLM and SGLang use: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, and output constraints
(`guided_json` / `json_schema`, `guided_regex` / `regex`, `guided_choice` / `choice`, `guided_grammar` /
`grammar`, vLLM's `structured_outputs` object). Known extensions this server does not implement are
refused (`REFUSED_EXTENSIONS`); other unknown fields are ignored, as OpenAI clients send some of their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from parrot.frontend.chat_prompt import TEMPLATE_VARIABLES
from parrot.frontend.openai_errors import OpenAIError, unsupported
from parrot.frontend.strict_schema import strict_schema
from parrot.protocol import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from parrot.serve.sampling_defaults import SamplingDefaults

MAX_N = 16
MAX_TOP_LOGPROBS = MAX_LOGPROBS
SCHEMA_NAME_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")

# other servers' extensions that would change the output if they were honoured: refused, not ignored, unless
# given as their neutral value (what the server they come from does when they are left out): None, or these
REFUSED_EXTENSIONS = {
    "ebnf": "ebnf (SGLang's GBNF grammars; give a Lark grammar as `grammar`)",
    "guided_decoding_backend": "guided_decoding_backend (one matcher is built in)",
    "guided_whitespace_pattern": "guided_whitespace_pattern",
    "use_beam_search": "beam search", "length_penalty": "length_penalty", "bad_words": "bad_words",
    "allowed_token_ids": "allowed_token_ids", "logits_processors": "logits_processors",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "truncate_prompt_tokens": "truncate_prompt_tokens", "return_tokens_as_token_ids": "return_tokens_as_token_ids",
    "prompt_logprobs": "prompt_logprobs (on /v1/completions, echo with logprobs gives the prompt's)",
    "return_token_ids": "return_token_ids",
    "chat_template": "a request's own chat_template", "documents": "documents",
    "mm_processor_kwargs": "mm_processor_kwargs", "lora_request": "LoRA adapters",
    # llama.cpp's server samplers
    "typical_p": "typical_p", "tfs_z": "tfs_z", "mirostat": "mirostat", "dry_multiplier": "dry_multiplier",
    "xtc_probability": "xtc_probability", "n_probs": "n_probs (give logprobs)",
}
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "bad_words": ([],), "logits_processors": ([],),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "documents": ([],),
    "mm_processor_kwargs": ({},), "typical_p": (1.0,), "tfs_z": (1.0,), "mirostat": (0,), "dry_multiplier": (0.0,),
    "xtc_probability": (0.0,), "n_probs": (0,),
}


def refuse_extensions(extra: dict[str, Any] | None, names: Iterable[str] = REFUSED_EXTENSIONS) -> None:
    """A 400 for the first of `names` given in `extra` (a request's unknown fields) with an effect."""
    for name in sorted(set(extra or {}) & set(names)):
        value = (extra or {})[name]
        neutral = NEUTRAL_VALUES.get(name, ())
        if value is None or value in neutral:
            continue
        what = REFUSED_EXTENSIONS[name]
        raise unsupported(name, f"{what} other than {json.dumps(neutral[0])}" if neutral else what)


def _null_is(default: Any) -> Any:
    """A before-validator taking `null`, for a field OpenAI marks nullable that this server types without None,
    as `default` (vLLM takes null the same way)."""
    def check(value: Any) -> Any:
        return default if value is None else value

    return check


def supports(name: str) -> bool:
    """Whether the engine's SamplingParams has this field (so the request parameter can be honoured)."""
    return name in SamplingParams.model_fields


def require(field: str, param: str, what: str | None = None) -> None:
    if not supports(field):
        raise unsupported(param, what or param)


def _schema_value(value: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as JSON text (SGLang sends text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise OpenAIError(400, f"{param} is not valid JSON: {exc}", param=param) from None
    if isinstance(value, bool):
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{param} must be a JSON schema object, got {type(value).__name__}", param=param)
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage so far in every chunk too


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str  # required, as OpenAI and vLLM have it
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """The parameters completions and chat share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="extension; 0 or -1: whole vocabulary")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="extension")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="extension")
    seed: int | None = Field(None, ge=-2**63, lt=2**63, description="a 64-bit integer, as vLLM takes it")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (vLLM): generate max_tokens tokens regardless of EOS
    include_stop_str_in_output: bool = False  # extension (vLLM): the stop string (or stop token's text) kept
    min_tokens: int | None = Field(None, ge=0, description="extension")
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="extension")
    response_format: ResponseFormat | None = None
    # output constraints (extensions): vLLM's guided_* names, SGLang's / vLLM's plain names
    guided_json: Any = None
    json_schema: Any = None
    guided_regex: str | None = None
    regex: str | None = None
    guided_choice: list[str] | None = None
    choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's: the prompt shares cached prefixes only with requests of the same salt (multi-tenant isolation of
    # the prefix cache: another tenant cannot tell from cached_tokens or timing what was sent)
    cache_salt: str | None = Field(None, min_length=1, description="extension")
    # accepted, no effect on the output
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching is automatic
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    _null_n = field_validator("n", mode="before")(_null_is(1))
    _null_flags = field_validator("stream", "ignore_eos", "include_stop_str_in_output", mode="before")(_null_is(False))

    def check_common(self) -> None:
        refuse_extensions(self.model_extra)
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", f"service_tier {self.service_tier!r}")
        if self.store:
            raise unsupported("store", "store (stored completions)")
        if self.metadata:
            raise unsupported("metadata", "metadata (it goes with store)")

    def usage_in_chunks(self) -> bool:
        """vLLM's continuous usage statistics: every streamed chunk carries its choice's usage so far (with
        include_usage, as vLLM takes it)."""
        o = self.stream_options
        return o is not None and o.include_usage and o.continuous_usage_stats

    def stops(self) -> list[str]:
        """`stop` as a list (their number, emptiness and length are `SamplingParams`'s checks)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    # ---- constraints -------------------------------------------------------------------------------
    def constraint(self) -> tuple[str, Any, str] | None:
        """The one output constraint asked for: (SamplingParams field, value, the parameter that asked)."""
        found: list[tuple[str, Any, str]] = []
        rf = self.response_format
        if rf is not None:
            if rf.type == "json_object":
                found.append(("json_schema", {"type": "object"}, "response_format"))
            elif rf.type == "json_schema":
                spec = rf.json_schema
                if spec is None or spec.schema_ is None:
                    raise OpenAIError(400, "response_format.json_schema.schema is required",
                                      param="response_format.json_schema")
                if not SCHEMA_NAME_RE.fullmatch(spec.name):
                    raise OpenAIError(400, "response_format.json_schema.name must be 1 to 64 of a-z, A-Z, 0-9, _ "
                                      "and -", param="response_format.json_schema.name")
                schema = strict_schema(spec.schema_) if spec.strict else spec.schema_
                found.append(("json_schema", schema, "response_format"))
            elif rf.type != "text":
                raise unsupported("response_format", f"response_format {rf.type!r} (text, json_object, json_schema)")
        for field, names in (("json_schema", ("guided_json", "json_schema")), ("regex", ("guided_regex", "regex")),
                             ("choice", ("guided_choice", "choice")), ("grammar", ("guided_grammar", "grammar"))):
            for name in names:
                value = getattr(self, name)
                if value is not None:
                    found.append((field, value, name))
        so = self.structured_outputs
        if so:
            for key, field in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                               ("grammar", "grammar")):
                if so.get(key) is not None:
                    found.append((field, so[key], f"structured_outputs.{key}"))
            if so.get("json_object"):
                found.append(("json_schema", {"type": "object"}, "structured_outputs.json_object"))
            unknown = set(so) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise unsupported("structured_outputs", f"structured_outputs {sorted(unknown)}")
        if not found:
            return None
        if len(found) > 1:
            raise OpenAIError(400, f"give one output constraint, not {len(found)} ({', '.join(f[2] for f in found)})",
                              param=found[1][2])
        field, value, param = found[0]
        if field == "json_schema":
            value = _schema_value(value, param)
        elif field == "choice":
            if not value or any(not isinstance(c, str) or not c for c in value):
                raise OpenAIError(400, f"{param} must be a non-empty list of non-empty strings", param=param)
        elif not isinstance(value, str) or not value:
            raise OpenAIError(400, f"{param} must be a non-empty string", param=param)
        require(field, param, f"{param} (output constraints)")
        return field, value, param

    # ---- the engine's sampling parameters -----------------------------------------------------------
    def sampling_fields(self, max_tokens: int, defaults: SamplingDefaults, vocab_size: int | None) -> dict[str, Any]:
        """SamplingParams fields shared by every choice (seeds are per choice). Left-out sampling settings
        take `defaults`, field by field."""
        d = defaults.values
        out: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": self.temperature if self.temperature is not None else d.get("temperature", 1.0),
            "top_p": self.top_p if self.top_p is not None else d.get("top_p", 1.0),
            "top_k": max(0, self.top_k) if self.top_k is not None else int(d.get("top_k", 0)),
            "stop": self.stops(), "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        min_p = self.min_p if self.min_p is not None else d.get("min_p")
        if self.min_p is not None:
            require("min_p", "min_p")
        if min_p and supports("min_p"):
            out["min_p"] = min_p
        rep = self.repetition_penalty if self.repetition_penalty is not None else d.get("repetition_penalty")
        if self.repetition_penalty is not None and self.repetition_penalty != 1.0:
            require("repetition_penalty", "repetition_penalty")
        if rep is not None and rep != 1.0 and supports("repetition_penalty"):
            out["repetition_penalty"] = rep
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value:
                require(name, name)
                out[name] = value
        if self.min_tokens:
            require("min_tokens", "min_tokens")
            if self.min_tokens > max_tokens:
                raise OpenAIError(400, f"min_tokens ({self.min_tokens}) is more than max_tokens ({max_tokens})",
                                  param="min_tokens")
            out["min_tokens"] = self.min_tokens
        if self.logit_bias:
            require("logit_bias", "logit_bias")
            out["logit_bias"] = self.token_bias(vocab_size)
        constraint = self.constraint()
        if constraint is not None:
            out[constraint[0]] = constraint[1]
        return out

    def token_bias(self, vocab_size: int | None) -> dict[int, float]:
        """OpenAI's logit_bias: token ids (as JSON object keys, so strings) -> a bias in [-100, 100]."""
        bias: dict[int, float] = {}
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS:
            raise OpenAIError(400, f"logit_bias has more than {MAX_LOGIT_BIAS} entries", param="logit_bias")
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"\d{1,9}", key.strip()):
                raise OpenAIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
            tid = int(key)
            if vocab_size is not None and tid >= vocab_size:
                raise OpenAIError(400, f"logit_bias token id {tid} is outside the vocabulary (size {vocab_size})",
                                  param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise OpenAIError(400, f"logit_bias value {value} for token {tid} is not within [-100, 100]",
                                  param="logit_bias")
            bias[tid] = float(value)
        return bias

    def sampling(self, fields: dict[str, Any], index: int) -> SamplingParams:
        seed = None if self.seed is None else (self.seed + index) % 2**64  # choice i: seed + i, all 64 bits
        try:
            return SamplingParams(**fields, seed=seed)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
            param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None  # the request's own name
            raise OpenAIError(400, f"invalid sampling parameters: {problems}", param=param) from None


Prompt = str | list[int]  # text, or token ids given as they are


def _prompt_shape(value: Any) -> Any:
    """`prompt`'s four shapes (a string, strings, token ids, lists of token ids), checked before pydantic's
    union so a wrong one gets one clear message instead of one per union member."""
    if isinstance(value, str) or not isinstance(value, list) or not value:
        return value  # a string; not a list (pydantic says so); [] (check() says so)

    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if all(isinstance(x, str) for x in value) or all(is_id(x) for x in value):
        return value
    if all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            if not all(is_id(x) for x in ids):
                raise PydanticCustomError("prompt", "prompt {i} must be a list of integer token ids", {"i": i})
        return value
    kinds = ", ".join(dict.fromkeys("token id" if is_id(x) else type(x).__name__ for x in value))
    raise PydanticCustomError(
        "prompt", "prompt must be a string, a list of strings, a list of token ids (integers) or a list of lists "
        "of token ids; this list holds {kinds}", {"kinds": kinds})


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids (one prompt) or lists of token ids (several prompts); "
                    "n choices each")
    max_tokens: int | None = Field(None, ge=0, description="0 (with echo): the prompt alone, scored")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    _prompt_shape = field_validator("prompt", mode="before")(_prompt_shape)
    _null_echo = field_validator("echo", mode="before")(_null_is(False))

    def check(self, vocab_size: int | None = None) -> list[Prompt]:
        """The prompts, each a string or a list of token ids (sent to the engine as given: they must lie in
        [0, vocab_size) when the vocabulary's size is known)."""
        self.check_common()
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion)")
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "best_of other than n")
        if self.logprobs is not None:
            require("logprobs", "logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens 0 needs echo: true (the prompt and its logprobs, nothing generated)",
                              param="max_tokens")
        prompt = self.prompt
        prompts: list[Prompt]
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(x, int) for x in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type] - one prompt of token ids
        else:
            prompts = [p if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[union-attr]
        if not prompts:
            raise OpenAIError(400, "prompt must not be an empty list", param="prompt")
        if len(prompts) * self.n > MAX_N * 4:
            raise OpenAIError(400, f"at most {MAX_N * 4} choices (prompts x n) per request", param="n")
        for i, p in enumerate(prompts):
            if not p:
                which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
                raise OpenAIError(400, f"{which} is empty" if isinstance(p, str) else
                                  f"{which} is an empty list of token ids", param="prompt")
            if isinstance(p, list) and vocab_size is not None:
                bad = [t for t in p if not 0 <= t < vocab_size]
                if bad:
                    raise OpenAIError(400, f"token ids {bad[:5]} are outside the vocabulary (ids 0 to "
                                      f"{vocab_size - 1})", param="prompt")
        return prompts

    def logprob_fields(self) -> dict[str, Any]:
        return {} if self.logprobs is None else {"logprobs": self.logprobs}

    @property
    def prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs`: the prompt tokens' logprobs too (what loglikelihood evaluations read)."""
        return self.logprobs if self.echo else None


Modality = Literal["text"]


class ChatTemplateOptions(BaseModel):
    """vLLM's chat template options (/v1/chat/completions and /tokenize): the generation prompt or not,
    `continue_final_message` (the model goes on with the final message: a prefilled answer), and more of the
    template's variables (`chat_template_kwargs`, e.g. `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_options(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(400, "continue_final_message and add_generation_prompt cannot both be true (set "
                              "add_generation_prompt false to continue the final message)",
                              param="continue_final_message")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_VARIABLES)
        if taken:
            raise OpenAIError(400, f"chat_template_kwargs cannot set {', '.join(taken)}: the server gives the "
                              "template those", param="chat_template_kwargs")


class ChatCompletionRequest(ChatTemplateOptions, SamplingRequest):
    messages: list[Any] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    verbosity: str | None = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None

    def check(self) -> None:
        self.check_common()
        self.check_template_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.logprobs:
            require("logprobs", "logprobs")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise unsupported("modalities", f"modalities {self.modalities} (text only)")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options", "verbosity", "moderation",
                     "prompt_cache_options"):
            if getattr(self, name) is not None:
                raise unsupported(name, name)
        if (self.model_extra or {}).get("echo"):  # vLLM's chat echo (the last message's text prepended)
            raise unsupported("echo", "echo on chat completions (vLLM's extension)")
        if self.prompt_cache_retention not in (None, "in_memory"):  # cached prefixes live in engine memory
            raise unsupported("prompt_cache_retention", f"prompt_cache_retention {self.prompt_cache_retention!r}")

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}
