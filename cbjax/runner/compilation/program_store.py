"""Compiled step programs saved on disk, so a second process neither traces nor compiles them.

jax's persistent compilation cache (jax_cache.py) skips XLA's compile, but a process still traces and lowers
every step program to find it there (~0.5-0.8 s a bucket on 2 cores: most of a warm start). This cache keeps the
compiled executables themselves (jax.experimental.serialize_executable), in a folder of the compilation cache.

An entry's key is a hash of everything the program depends on: jax and jaxlib versions, the device, XLA_FLAGS and
the jax options that change lowering, the caller's description of the program (model config, argument shapes,
bucket, options), and the source of every module that is traced into it (the cbjax.model, cbjax.runner and
kernels_pallas packages, C++ kernels included), so an edit to that code, an upgrade or another model is a miss,
never a stale program. An unreadable or incompatible entry is a miss too. Executables can run code: keep the
cache directory private, as jax asks for its own cache.
"""

import contextlib
import functools
import hashlib
import os
import pathlib

import jax
import jaxlib

# Packages whose code is traced into a step program.
_TRACED_PACKAGES = ("cbjax/model", "cbjax/runner", "kernels_pallas")
_ROOT = pathlib.Path(__file__).resolve().parents[3]


@functools.cache
def _sources_digest() -> str:
    h = hashlib.sha256()
    for package in _TRACED_PACKAGES:
        # Every file of the package and its subpackages (C++ sources and headers included), named by its path.
        paths = (p for pattern in ("*.py", "*.cc", "*.h") for p in (_ROOT / package).rglob(pattern))
        for path in sorted(paths):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> tuple:
    device = jax.devices()[0]
    return (
        jax.__version__,
        jaxlib.__version__,
        device.platform,
        getattr(device, "device_kind", ""),
        os.environ.get("XLA_FLAGS", ""),
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
        _sources_digest(),
    )


class ProgramStore:
    """Serialized compiled programs in `directory`, by a key that describes them (see the module docstring). Past
    `max_bytes` the least recently used entries are deleted (every code edit makes new keys)."""

    def __init__(self, directory: str, max_bytes: int = 512 * 2**20):
        self.directory = directory
        self.max_bytes = max_bytes

    def path(self, description: tuple) -> str:
        digest = hashlib.sha256(repr((_environment(), description)).encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{digest}.bin")

    def load(self, description: tuple, in_tree, out_tree, device=None):
        """The compiled program saved under `description`, or None. It runs on `device` (default: jax's first).

        (Without naming its device, a single-device program loads as one for every local device, and on a host
        with several (a multi-chip TPU VM, fake CPU devices) its first call fails: "Expected ... 2 shards".)"""
        path = self.path(description)
        if not os.path.isfile(path):
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            devices = [device if device is not None else jax.devices()[0]]
            program = deserialize_and_load(
                pathlib.Path(path).read_bytes(), in_tree, out_tree, execution_devices=devices
            )
        except Exception:  # written by an incompatible build, or truncated: compile instead
            return None
        os.utime(path)  # recently used: evicted last
        return program

    def save(self, description: tuple, compiled, in_tree, out_tree) -> None:
        """Save `compiled` (best effort: a program that cannot be serialized is simply not cached)."""
        from jax.experimental.serialize_executable import serialize

        try:
            blob, got_in, got_out = serialize(compiled)
        except Exception:
            return
        if (got_in, got_out) != (in_tree, out_tree):
            return  # not what load() would rebuild it with
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(description)
        tmp = f"{path}.{os.getpid()}.tmp"
        pathlib.Path(tmp).write_bytes(blob)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        self._evict()

    def _evict(self) -> None:
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".bin"):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # another process evicted it between the listing and now
                    continue
                entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):  # another process may have removed it
                os.remove(path)
            total -= size
