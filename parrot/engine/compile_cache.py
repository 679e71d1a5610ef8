"""The persistent compilation cache: where it lives and what happens when it is unusable.

Entries go to `<dir>/<fingerprint>`, the fingerprint naming the JAX and jaxlib versions and the CPU's
instruction-set flags, so a cache shared between machines (a network home directory, a copied
image) never hands one CPU code compiled for another. A directory that cannot be created or written
gets one warning and compiling goes on without the cache; entries that cannot be read or written
(corrupt, truncated, foreign, a full disk) are recompiled, with one warning for all of them instead
of JAX's one per entry; one that does not decompress is removed, so that it is written again (JAX never
writes over an entry that exists).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import jax
import jaxlib
from jax._src import compilation_cache as jax_compilation_cache  # reset_cache: JAX decides "used" once

T = TypeVar("T")

log = logging.getLogger(__name__)

_JAX_CACHE_ERROR = "persistent compilation cache entry"  # in JAX's read and write warnings
_JAX_READ_ERROR = re.compile(r"[Ee]rror reading persistent compilation cache entry for '([^']+)'")
_warned = False


def fingerprint() -> str:
    """What a compiled executable depends on beyond its program: versions, backend, CPU features and
    the native kernels' source."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    from parrot.engine import kernels  # executables call its FFI targets by name: their ABI is in the key

    key = (f"{jax.__version__}|{jaxlib.__version__}|{jax.default_backend()}|{platform.machine()}|{flags}|"
           f"{kernels.source_hash()}")
    return f"jax{jax.__version__}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def enable_compilation_cache(directory: str | None) -> Path | None:
    """Use `directory` (namespaced by `fingerprint()`) as JAX's persistent cache; None if unusable."""
    if not directory:
        return None
    path = Path(directory).expanduser() / fingerprint()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        log.warning("compilation cache %s is not usable (%s); compiling without it", directory, exc)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _collapse_entry_warnings(path)
    return path


def set_cache_dir(directory: str | None) -> None:
    """Point JAX's persistent cache at `directory` as it is (None: off), taking effect at the next compile (JAX
    decides once whether the cache is used: that decision is reset)."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax_compilation_cache.reset_cache()


def _collapse_entry_warnings(path: Path) -> None:
    """Turn JAX's warning per unreadable or unwritable cache entry into one log line."""
    show = warnings.showwarning
    if getattr(show, "_parrot_cache", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        global _warned
        if _JAX_CACHE_ERROR not in str(message):
            return show(message, category, filename, lineno, file, line)
        read = _JAX_READ_ERROR.search(str(message))
        removed = _remove_unreadable(path, read.group(1)) if read else 0
        if not _warned:
            _warned = True
            log.warning("compilation cache %s has entries that cannot be read or written (first: %s); those "
                        "shapes are compiled normally%s", path, str(message)[:300],
                        "; unreadable entries are removed, to be written again" if removed else "")
        return None

    showwarning._parrot_cache = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


def _remove_unreadable(path: Path, name: str) -> int:
    """Remove the entries of function `name` in the cache directory `path` that do not decompress (a write cut
    short, say by a killed process): JAX never writes over an entry that exists, so one left there would be
    compiled again, and warned about, at every start. Returns how many were removed."""
    removed = 0
    for entry in path.glob(f"{name}-*-cache"):
        try:
            jax_compilation_cache.decompress_executable(entry.read_bytes())
            continue
        except OSError:
            continue  # gone, or not ours to read
        except Exception:  # noqa: BLE001 (whatever the decompressor raises: the entry is unreadable)
            pass
        for part in (entry, entry.with_name(entry.name[: -len("-cache")] + "-atime")):
            try:
                part.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                return removed
        removed += 1
    return removed


def compile_with_fallback(compile_fn: Callable[[], T], what: object) -> T:
    """Run `compile_fn`; if it fails (e.g. a cache entry that loads but does not fit its program), stop
    using the persistent cache in this process, move its entries aside (the next start writes a clean
    one) and compile again."""
    try:
        return compile_fn()
    except Exception as exc:  # noqa: BLE001 (any failure through the cache gets a clean second try)
        if not _drop_cache(f"compiling {what} failed with {type(exc).__name__}: {str(exc)[:200]}"):
            raise
        return compile_fn()


_lock = threading.Lock()


def _drop_cache(reason: str) -> bool:
    """Turn the persistent cache off for this process (once); False if it was not on."""
    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if current is None:
            return True  # another thread turned it off already
        set_cache_dir(None)
        moved = Path(current).with_name(f"{Path(current).name}.unusable-{int(time.time())}")
        try:
            Path(current).rename(moved)
        except OSError:
            moved = Path(current)
        log.warning("compilation cache %s gave an unusable entry (%s); compiling without it (entries moved to %s)",
                    current, reason, moved)
        return True
