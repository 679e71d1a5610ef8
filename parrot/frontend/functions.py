"""Semantic and native functions: Python functions that become calls into a Parrot session's graph.

    import parrot as P

    @P.semantic_function
    def summarize(text: P.Input, summary: P.Output(max_tokens=64)):
        \"\"\"Summarize: {{text}}
        Summary: {{summary}}\"\"\"

    with P.VirtualMachine("http://127.0.0.1:9000"):
        s = summarize("a long text ...")   # a SemanticVariable; nothing waits here
        print(s.get())

Calling a function submits one call and returns its output variable(s) at once; the server runs the
graph when something is read (or right away with `output_criteria=`).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any, overload

from pydantic import BaseModel

from parrot.frontend.sdk import Criterion, SemanticVariable, VirtualMachine, current_vm
from parrot.frontend.strict_schema import strict_schema
from parrot.protocol import SamplingParams


class Input:
    """Annotation of an input parameter: bound to a `str` value or a `SemanticVariable`."""

    def __repr__(self) -> str:
        return "Input()"


class Output:
    """Annotation of an output parameter, with how it is generated. Fields left out use the server's
    defaults (`max_tokens`: the server's default; greedy decoding). Invalid values raise at decoration.

    A typed output is constrained on the server so its text always matches (at most one of):
    `schema` (a pydantic model class: `.get()` returns an instance; or a JSON schema dict: `.get()` returns
    the parsed JSON), `choices` (the text is one of these strings), `regex` (the text matches it) or
    `grammar` (a Lark grammar, llguidance syntax). A typed output that runs out of `max_tokens` before its
    text is complete fails (VariableFailedError) instead of giving a partial value."""

    _FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")

    def __init__(self, max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool | None = None, *, schema: type[BaseModel] | dict[str, Any] | None = None,
                 choices: Sequence[str] | None = None, regex: str | None = None, grammar: str | None = None) -> None:
        values = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                      stop=[stop] if isinstance(stop, str) else (list(stop) if stop is not None else None),
                      ignore_eos=ignore_eos)
        self.sampling: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
        self.parse: Callable[[str], Any] | None = None
        given = [n for n, v in (("schema", schema), ("choices", choices), ("regex", regex), ("grammar", grammar))
                 if v is not None]
        if len(given) > 1:
            raise TypeError(f"P.Output takes one of schema, choices, regex, grammar; got {', '.join(given)}")
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            self.sampling["json_schema"] = strict_schema(schema.model_json_schema())  # only the model's fields
            self.parse = schema.model_validate_json
        elif isinstance(schema, dict):
            self.sampling["json_schema"] = schema
            self.parse = json.loads
        elif schema is not None:
            raise TypeError(f"P.Output(schema=...) takes a pydantic model class or a JSON schema dict, got {schema!r}")
        if choices is not None:
            if isinstance(choices, str):
                raise TypeError("P.Output(choices=...) takes a list of strings, not one string")
            self.sampling["choice"] = list(choices)
        if regex is not None:
            self.sampling["regex"] = regex
        if grammar is not None:
            self.sampling["grammar"] = grammar
        SamplingParams(**self.sampling)  # validate now (ranges) rather than at the first call

    def __repr__(self) -> str:
        return "Output(" + ", ".join(f"{k}={v!r}" for k, v in self.sampling.items()) + ")"

    def sampling_config(self) -> dict[str, Any] | None:
        """The call's `sampling_config`: None when nothing was set, so the server's defaults apply."""
        if not self.sampling:
            return None
        # only what was set: a server of another version takes it (the defaults are its own)
        return SamplingParams(**self.sampling).model_dump(exclude_none=True, exclude_unset=True)


def _vm(vm: VirtualMachine | None) -> VirtualMachine:
    return vm if vm is not None else current_vm()


def _ports(fn: Callable, what: str) -> list[tuple[str, Input | Output]]:
    """The parameters of `fn` in order, each with its Input / Output annotation (classes instantiated)."""
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as exc:  # noqa: BLE001 - any failure evaluating string annotations
        raise TypeError(f"{what} {fn.__qualname__}: cannot evaluate its annotations: {exc}") from exc
    ports: list[tuple[str, Input | Output]] = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"{what} {fn.__qualname__}: *args / **kwargs are not supported ({name})")
        ann = hints.get(name)
        if ann is Input or ann is Output:
            ann = ann()
        if not isinstance(ann, (Input, Output)):
            raise TypeError(f"{what} {fn.__qualname__}: parameter {name!r} must be annotated P.Input or "
                            f"P.Output(...), got {ann!r}")
        ports.append((name, ann))
    return ports


def _bind_args(fn_name: str, ports: list[tuple[str, Input | Output]], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Positional then keyword arguments onto the ports (outputs may be given a variable to fill)."""
    names = [n for n, _ in ports]
    if len(args) > len(names):
        raise TypeError(f"{fn_name}() takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args, strict=False))
    for k, v in kwargs.items():
        if k not in names:
            raise TypeError(f"{fn_name}() got an unexpected argument {k!r}")
        if k in bound:
            raise TypeError(f"{fn_name}() got multiple values for argument {k!r}")
        bound[k] = v
    missing = [n for n, ann in ports if isinstance(ann, Input) and n not in bound]
    if missing:
        raise TypeError(f"{fn_name}() missing input(s): {', '.join(missing)}")
    for n, ann in ports:
        v = bound.get(n)
        if isinstance(ann, Output) and v is not None and not isinstance(v, SemanticVariable):
            raise TypeError(f"{fn_name}(): output {n!r} can only be given a SemanticVariable to fill, "
                            f"got {type(v).__name__}")
    return bound


def _result(outs: list[SemanticVariable]) -> SemanticVariable | tuple[SemanticVariable, ...] | None:
    if not outs:
        return None
    return outs[0] if len(outs) == 1 else tuple(outs)


class SemanticFunction:
    """A prompt template with typed placeholders; calling it submits a semantic call."""

    def __init__(self, fn: Callable, template: str | None = None, output_criteria: Criterion | None = None,
                 models: list[str] | None = None) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.ports = _ports(fn, "semantic function")
        reserved = [n for n, _ in self.ports if n in ("vm", "output_criteria")]
        if reserved:  # a call takes them as its own keywords: such a parameter could not be passed by name
            raise TypeError(f"semantic function {fn.__qualname__}: parameter {reserved[0]!r} is a name its calls take "
                            "for themselves (vm=, output_criteria=): rename it")
        if template is None:
            if not fn.__doc__ or not fn.__doc__.strip():
                raise TypeError(f"semantic function {fn.__qualname__}: its docstring (the template) is empty")
            template = inspect.cleandoc(fn.__doc__)
        self.template = template
        self.output_criteria = output_criteria
        self.models = models
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"SemanticFunction({self.name}, ports={[n for n, _ in self.ports]})"

    @property
    def outputs(self) -> list[str]:
        return [n for n, ann in self.ports if isinstance(ann, Output)]

    def parameters(self, bound: dict[str, Any], vm: VirtualMachine) -> list[dict[str, Any]]:
        params: list[dict[str, Any]] = []
        for name, ann in self.ports:
            if isinstance(ann, Output):
                p: dict[str, Any] = {"name": name, "is_output": True}
                cfg = ann.sampling_config()
                if cfg is not None:
                    p["sampling_config"] = cfg
                if bound.get(name) is not None:
                    p["var_id"] = vm._bind(name, bound[name])["var_id"]
            else:
                p = {"name": name, "is_output": False, **vm._bind(name, bound[name])}
            params.append(p)
        return params

    def __call__(self, *args: Any, vm: VirtualMachine | None = None, output_criteria: Criterion | None = None,
                 **kwargs: Any) -> SemanticVariable | tuple[SemanticVariable, ...] | None:
        """Submit the call (one HTTP request, no waiting) and return the output variable, or a tuple of
        them in declaration order for several outputs. Errors in the template or bindings raise here."""
        machine = _vm(vm)
        bound = _bind_args(self.name, self.ports, args, kwargs)
        made = machine.semantic_call(self.template, self.parameters(bound, machine),
                                     output_criteria=output_criteria or self.output_criteria, models=self.models)
        for name, ann in self.ports:
            if isinstance(ann, Output) and ann.parse is not None:
                made[name].parse = ann.parse  # typed: .get() returns the parsed value
                if bound.get(name) is not None:  # the variable the caller gave to fill reads as typed too
                    bound[name].parse = ann.parse
        return _result([made[n] for n in self.outputs])


@overload
def semantic_function(fn: Callable, /, *, template: str | None = None, output_criteria: Criterion | None = None,
                      models: list[str] | None = None) -> SemanticFunction: ...
@overload
def semantic_function(*, template: str | None = None, output_criteria: Criterion | None = None,
                      models: list[str] | None = None) -> Callable[[Callable], SemanticFunction]: ...
def semantic_function(fn: Callable | None = None, /, *, template: str | None = None,
                      output_criteria: Criterion | None = None, models: list[str] | None = None):  # noqa: ANN201
    """Decorator: the function's docstring (or `template=`) is the prompt, `{{name}}` its placeholders;
    each parameter is annotated `P.Input` or `P.Output(...)`. `output_criteria` ("latency" or
    "throughput") makes every call run at once instead of when an output is read. `models`: the model names
    its calls may run on (a call fails with a 404 where the server serves none of them)."""
    if fn is not None:  # P.semantic_function(fn, template=...) as well as the bare decorator
        return SemanticFunction(fn, template=template, output_criteria=output_criteria, models=models)
    return lambda f: SemanticFunction(f, template=template, output_criteria=output_criteria, models=models)


# ---- native functions -----------------------------------------------------------------------------------
def transform(name: str, params: dict[str, Any] | None = None, /, *, vm: VirtualMachine | None = None,
              outputs: Sequence[str] | None = None,
              **inputs: str | SemanticVariable) -> SemanticVariable | tuple[SemanticVariable, ...]:
    """Run the server-side string transform `name` (docs/native-functions.md) as a graph node of the
    current VM (or `vm=`): `P.transform("upper", text=s)`, `P.transform("join", {"sep": "\\n"}, a=x, b=y)`.
    Returns the output variable (tuple for several `outputs`) at once; nothing waits."""
    return _vm(vm).transform(name, params, outputs=outputs, **inputs)


class NativeFunction:
    """A transform with fixed params behind a Python signature: `Input` parameters are the transform's
    inputs (in order), `Output` parameters name its outputs (default: one output named `output`)."""

    def __init__(self, fn: Callable, transform: str, params: dict[str, Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.transform = transform
        self.params = params
        self.ports = _ports(fn, "native function")
        outs = [n for n, ann in self.ports if isinstance(ann, Output)]
        self.inputs = [n for n, ann in self.ports if isinstance(ann, Input)]
        self.outputs = outs or ["output"]
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"NativeFunction({self.name}, transform={self.transform!r})"

    def __call__(self, *args: Any, vm: VirtualMachine | None = None,
                 **kwargs: Any) -> SemanticVariable | tuple[SemanticVariable, ...]:
        bound = _bind_args(self.name, [(n, a) for n, a in self.ports if isinstance(a, Input)], args, kwargs)
        inputs = {n: bound[n] for n in self.inputs}
        return _vm(vm).transform(self.transform, self.params, outputs=self.outputs, **inputs)


def native_function(transform: str, params: dict[str, Any] | None = None,
                    **kw_params: Any) -> Callable[[Callable], NativeFunction]:
    """Decorator over a stub whose parameters are annotated `P.Input` / `P.Output`:

        @P.native_function("regex_extract", pattern=r"Answer:\\s*(\\w+)", group=1)
        def extract_answer(text: P.Input): ...

    The transform's params come from `params` and/or keyword arguments; they are checked by the
    server when a call is submitted (an `InvalidRequestError` then)."""
    merged = {**(params or {}), **kw_params}
    return lambda fn: NativeFunction(fn, transform, merged)
