"""Parrot: serving LLM applications with semantic variables.

The names exported here are the Python SDK (a light HTTP client of a Parrot server; no JAX):

    import parrot as P

    @P.semantic_function
    def summarize(text: P.Input, summary: P.Output(max_tokens=64)):
        \"\"\"Summarize: {{text}}
        Summary: {{summary}}\"\"\"

    with P.VirtualMachine("http://127.0.0.1:9000"):
        print(summarize("...").get())

See docs/sdk.md.
"""

__version__ = "0.1.0"

from parrot.frontend.functions import (  # noqa: E402
    Input,
    NativeFunction,
    Output,
    SemanticFunction,
    native_function,
    semantic_function,
    transform,
)
from parrot.frontend.sdk import (  # noqa: E402
    AuthError,
    SemanticVariable,
    ServerError,
    VariableFailedError,
    VariableTimeoutError,
    VirtualMachine,
    current_vm,
)

__all__ = [
    "__version__", "AuthError", "Input", "NativeFunction", "Output", "SemanticFunction", "SemanticVariable",
    "ServerError", "VariableFailedError", "VariableTimeoutError", "VirtualMachine", "current_vm", "native_function",
    "semantic_function", "transform",
]
