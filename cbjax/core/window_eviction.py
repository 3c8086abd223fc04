"""Sliding-window eviction: a model that attends to its last `window` positions only never reads a page that lies
wholly before them again, so the scheduler frees such pages (CacheConfig.evict_outside_window). A sequence then
holds at most about window / page_size + 1 pages, however long it grows."""

from cbjax.core.page_pool import PagePool
from cbjax.core.request import Request
from cbjax.core.scheduler_config import pages_for


def max_pages_held(num_tokens: int, window: int, page_size: int, max_chunk: int) -> int:
    """The most pages a sequence of `num_tokens` holds at once: a window and a whole step's chunk at most."""
    return min(pages_for(num_tokens, page_size), pages_for(window + max_chunk - 1, page_size) + 1)


def drop_outside_window(pool: PagePool, req: Request, window: int, page_size: int) -> None:
    """Free the request's leading pages that hold only positions its next queries cannot read (the next query is at
    position num_computed_tokens and reads positions > it - window). Pages already in the prefix cache stay findable
    there until evicted."""
    first_read = max(0, req.num_computed_tokens - window + 1) // page_size  # logical page of the oldest readable
    k = min(first_read - req.num_dropped_pages, len(req.pages))
    if k > 0:
        pool.free(req.pages[:k])
        del req.pages[:k]
        req.num_dropped_pages += k
