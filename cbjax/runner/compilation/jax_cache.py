"""The persistent compilation cache: compiled step programs saved on disk, so the next process starts in seconds.

jax keeps one such cache per process (`jax_compilation_cache_dir`); cbjax turns it on by default, in a folder of
the user's cache directory, with the size and compile-time thresholds lowered so that every step program is kept
(jax's defaults skip programs that compiled in under a second, which is most of ours on a CPU).

The setting (EngineConfig.compilation_cache, or the CBJAX_COMPILATION_CACHE environment variable, which wins):
"auto" (the default: $XDG_CACHE_HOME/cbjax/jax-compile, else ~/.cache/cbjax/jax-compile), "off", or a directory.
A cache directory the user already gave jax (its config or JAX_COMPILATION_CACHE_DIR) is left as it is.
"""

import logging
import os

import jax

ENV_VAR = "CBJAX_COMPILATION_CACHE"
MAX_SIZE_BYTES = 2 * 2**30  # jax evicts least recently used entries beyond this

_log = logging.getLogger("cbjax")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cbjax", "jax-compile")


def configure_compilation_cache(setting: str = "auto") -> str | None:
    """Point jax's persistent compilation cache at the folder `setting` names; returns it (None: off)."""
    setting = os.environ.get(ENV_VAR, setting)
    current = jax.config.jax_compilation_cache_dir
    if setting == "off":
        if current:
            _log.info("cbjax: compilation_cache='off', but jax already caches in %s (set by the user)", current)
        return current or None
    path = default_cache_dir() if setting == "auto" else os.path.abspath(os.path.expanduser(setting))
    if current and os.path.abspath(current) != path:
        return current  # the user configured jax's cache themselves
    if current != path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"compilation_cache={setting!r}: cannot use {path} as a cache folder ({e})") from None
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        if jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", MAX_SIZE_BYTES)
        _log.warning(
            "cbjax: persistent compilation cache in %s (engine option compilation_cache='off' or %s=off to disable)",
            path,
            ENV_VAR,
        )
    return path
