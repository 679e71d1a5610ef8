"""Compiled executables kept on disk by what they were built from, so that a warm start loads them without
tracing and lowering every function again.

JAX's persistent cache (compile_cache.py) keys an entry by the lowered program: to find it, each function is
traced and lowered first, and on a 2-core CPU that is most of a warm start's compile time (the default model's
shapes: ~21 of the ~26 s its compile threads were busy; reading the entries ~2 s). This cache keys an
executable by what the program is made from instead:
- the runner's context (`context`): Parrot's source, the model's and engine's settings, the layer's graph
  (static attributes such as block types), the dtypes the runner derived, the native kernels' state, the
  PARROT_/XLA_/JAX_ environment and JAX's settings, the devices;
- the function's name and its arguments' tree, shapes, dtypes and shardings, with static arguments' values.
Same key, same program: the entry is JAX's own serialized executable (`jax.experimental.serialize_executable`)
with its argument and result trees. It lives in JAX's cache directory (`executables/`), so it is on and off
with it, and under the same fingerprint (JAX versions, CPU flags, the kernels' source). An entry that does not
load is removed and compiled again (one warning); one that cannot be written is skipped (one warning).
Entries are pickles, as JAX's serialized executables are: the cache directory is trusted as the code is.

An executable that JAX read from its own cache serializes without its compiled functions (XLA's CPU client
keeps only what it loaded; such an entry fails at its first call: "Function ... not found"). So an entry
is written only from a compile this thread saw happen: a fresh one is serialized, and one that JAX's cache
gave is written with the bytes JAX read for it (`_watch`). An executable JAX's in-memory cache gave (no
compile seen) is not written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import pickle
import tempfile
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import flax
import jax
import numpy as np
from jax._src import compilation_cache as jax_compilation_cache  # the bytes of an entry JAX's cache gave
from jax._src import monitoring
from jax._src.lib import xla_client
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

SUBDIR = "executables"
_PACKAGE = Path(__file__).resolve().parents[1]  # parrot/
_warned: set[str] = set()
_warn_lock = threading.Lock()
stats = {"loaded": 0, "compiled": 0}  # this process's counts (tests and logs read them)
_stats_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Every Python and native source file of the package: a changed line changes every key."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def environment() -> str:
    """What outside the code changes a trace: the versions of what traces it (flax, numpy; JAX's are in the
    directory's name), the PARROT_/XLA_/JAX_ environment, JAX's settings (but where caches live), the devices."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("PARROT_", "XLA_", "JAX_")))
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    return repr((flax.__version__, np.__version__, env, settings, [str(d) for d in jax.devices()]))


def _describe(tree: object) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for leaf in leaves:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            parts.append(f"{tuple(leaf.shape)}/{leaf.dtype}/{getattr(leaf, 'sharding', None)}")
        else:
            parts.append(repr(leaf))
    return "|".join(parts)


_seen = threading.local()  # this thread's compile: .requested (JAX compiled or read its cache), .hit, .read (bytes)
_watching: list[bool] = []


def _on_event(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        _seen.requested = True
    elif event == "/jax/compilation_cache/cache_hits":  # the entry read (`_seen.read`) loaded
        _seen.hit = True


def _watch() -> None:
    """Note, on the compiling thread, that JAX compiled (or read its cache), and the bytes of an entry it read."""
    with _warn_lock:
        if _watching:
            return
        _watching.append(True)
        monitoring.register_event_listener(_on_event)
        extract = jax_compilation_cache.extract_executable_and_time

        def extract_and_keep(entry: bytes) -> tuple[bytes, int]:
            serialized, compile_time = extract(entry)
            _seen.read = serialized
            return serialized, compile_time

        jax_compilation_cache.extract_executable_and_time = extract_and_keep


class _Pickler(serialize_executable._JaxPjrtPickler):
    """JAX's pickler of a compiled executable, given the executable's bytes where JAX's cache gave them."""

    def __init__(self, file: io.BytesIO, raw: bytes | None) -> None:
        super().__init__(file)
        self.raw = raw

    def persistent_id(self, obj: object) -> object:
        if self.raw is not None and isinstance(obj, xla_client.LoadedExecutable):
            return ("exec", self.raw)
        return super().persistent_id(obj)


def _serialize(compiled: object, raw: bytes | None) -> tuple[bytes, object, object]:
    """As `serialize_executable.serialize`, with `raw` as the executable's bytes where given."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)  # type: ignore[attr-defined]
    if unloaded is None:
        raise ValueError("this compilation does not support serialization")
    args_info_flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)  # type: ignore[attr-defined]
    with io.BytesIO() as file:
        _Pickler(file, raw).dump((unloaded, args_info_flat, compiled._no_kwargs))  # type: ignore[attr-defined]
        return file.getvalue(), in_tree, compiled.out_tree  # type: ignore[attr-defined]


def _count(what: str) -> None:
    with _stats_lock:
        stats[what] += 1


def _warn_once(what: str, message: str, *args: object) -> None:
    with _warn_lock:
        if what in _warned:
            return
        _warned.add(what)
    log.warning(message, *args)


class ExecutableCache:
    """`compile(name, fn, *args, **kwargs)`: `fn.lower(*args, **kwargs).compile()`, or the same executable
    read from disk. `context`: everything the caller's jitted functions close over (see the module doc)."""

    def __init__(self, context: str, trace_state: Callable[[], str] = str) -> None:
        self.context = hashlib.sha256(f"{source_hash()}|{environment()}|{context}".encode()).hexdigest()
        self.trace_state = trace_state  # what this thread's traces depend on beyond `context` (the kernels' build)

    @staticmethod
    def directory() -> Path | None:
        """Where entries go: beside JAX's persistent cache, while that is on (one process only: an executable
        of a multi-process engine spans the processes' devices)."""
        current = jax.config.jax_compilation_cache_dir
        return None if not current or jax.process_count() > 1 else Path(current) / SUBDIR

    def key(self, name: str, args: tuple, kwargs: dict) -> str:
        described = f"{self.context}|{self.trace_state()}|{name}|{_describe((args, kwargs))}"
        return hashlib.sha256(described.encode()).hexdigest()

    def compile(self, name: str, fn: Callable, *args: object, **kwargs: object) -> Callable:
        directory = self.directory()
        path = None if directory is None else directory / f"{name}-{self.key(name, args, kwargs)[:32]}"
        if path is not None:
            loaded = self._load(path)
            if loaded is not None:
                _count("loaded")
                return loaded
            _watch()
        _seen.requested, _seen.hit, _seen.read = False, False, None
        compiled = fn.lower(*args, **kwargs).compile()  # type: ignore[attr-defined]
        _count("compiled")
        if path is not None and _seen.requested:  # else JAX's in-memory cache gave it: not kept (module doc)
            self._store(path, compiled, _seen.read if _seen.hit else None)
        return compiled

    @staticmethod
    def _load(path: Path) -> Callable | None:
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            _warn_once("read", "executable cache entry %s cannot be read (%s): compiling", path, exc)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(zlib.decompress(blob))
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as exc:  # noqa: BLE001 - any unusable entry is compiled again and written anew
            _warn_once("load", "executable cache entry %s does not load (%s: %s): removed, compiling again",
                       path, type(exc).__name__, str(exc)[:200])
            path.unlink(missing_ok=True)
            return None

    @staticmethod
    def _store(path: Path, compiled: object, raw: bytes | None) -> None:
        try:
            payload, in_tree, out_tree = _serialize(compiled, raw)
            blob = zlib.compress(pickle.dumps((payload, in_tree, out_tree)), 1)
        except Exception as exc:  # noqa: BLE001 - an executable JAX cannot serialize is just not kept
            _warn_once("serialize", "an executable cannot be kept on disk (%s: %s)", type(exc).__name__,
                       str(exc)[:200])
            return
        tmp_name = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as tmp:
                tmp_name = tmp.name
                tmp.write(blob)
            os.replace(tmp_name, path)
        except OSError as exc:
            _warn_once("write", "executable cache %s cannot be written (%s): compiling without keeping them",
                       path.parent, exc)
            if tmp_name is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)
