"""A KV pool against the memory that would hold it: the device's (the page pool) or the host's (the swap pool)."""

import os

import jax


def device_memory_bytes() -> int | None:
    """What this process's first device can hold (its allocator's limit; on the CPU backend, the machine's memory)."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return host_memory_bytes() if device.platform == "cpu" else None


def host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def check_fits(what: str, num_pages: int, page_size: int, page_bytes: int, limit: int | None) -> None:
    """A pool larger than the memory that would hold it is the user's sizing mistake (GiB vs bytes, one zero too
    many): a ValueError now, not an allocator failure or an out-of-memory kill later."""
    size = num_pages * page_bytes
    if limit is not None and size > limit:
        raise ValueError(
            f"the {what}: {num_pages} pages of {page_size} tokens = {size / 2**30:.3g} GiB, more than the "
            f"{limit / 2**30:.3g} GiB of memory there is to hold them"
        )
