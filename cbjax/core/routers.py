"""Routers of a data-parallel engine: which replica (its own scheduler and KV pool) a new request joins.

A router sees the request's prompt token ids and each replica's load: the tokens it still owes its unfinished
requests (prompt tokens not computed yet + output tokens not generated yet, at most max_tokens). Like the
scheduling policies, each is a small class selected by name (ROUTERS).
"""

from collections.abc import Sequence

from cbjax.config import validation as check


class Router:
    name = ""

    def choose(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        raise NotImplementedError


class RoundRobinRouter(Router):
    """Replicas in turn, whatever their load."""

    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, prompt, loads):
        i = self._next % len(loads)
        self._next += 1
        return i


class LeastLoadRouter(Router):
    """The replica owing the fewest tokens (ties: the lowest index)."""

    name = "least_load"

    def choose(self, prompt, loads):
        return min(range(len(loads)), key=lambda i: (loads[i], i))


class PrefixAffinityRouter(Router):
    """Requests whose prompts start alike go to the same replica, so its prefix cache serves them; a load bound keeps
    one replica from taking everything (sglang's cache-aware router balances the same way).

    The affinity key is the first `prefix_tokens` prompt tokens (a shorter prompt: all of it). The preferred
    replica is taken unless its load exceeds `balance_ratio` x the least loaded replica's load + `balance_slack`
    tokens; then the least loaded one is."""

    name = "prefix_affinity"

    def __init__(self, prefix_tokens: int = 64, balance_ratio: float = 1.5, balance_slack: int = 1024):
        self.prefix_tokens = check.integer("prefix_affinity prefix_tokens", prefix_tokens, 1)
        self.balance_ratio = check.real("prefix_affinity balance_ratio", balance_ratio, 1.0)
        self.balance_slack = check.integer("prefix_affinity balance_slack", balance_slack, 0)

    def choose(self, prompt, loads):
        key = tuple(prompt[: self.prefix_tokens])
        # A hash stable across processes (Python salts str hashes, not tuples of ints; still, spell it out).
        h = 0
        for t in key:
            h = (h * 1_000_003 + int(t) + 1) % (1 << 61)
        preferred = h % len(loads)
        least = min(range(len(loads)), key=lambda i: (loads[i], i))
        if loads[preferred] > self.balance_ratio * loads[least] + self.balance_slack:
            return least
        return preferred


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobinRouter, LeastLoadRouter, PrefixAffinityRouter)}


def make_router(name: str, options: dict | None = None) -> Router:
    check.choice("router", name, sorted(ROUTERS))
    options = check.mapping("router_options", options)
    try:
        return ROUTERS[name](**options)
    except TypeError as e:  # an option the router does not take
        raise ValueError(f"router {name!r}: {e}") from None
