"""A pure-Python stand-in for the model runner that makes scheduler bugs visible in the tokens.

The "KV cache" holds, per (page, offset), the token and position written there. A step first runs the swaps, then
writes every scheduled token's entry, then each sampling sequence reads its whole context back through its page
table and "samples" `next_token(context)`. A wrong page table, a page reused while still live, a lost swap, a
prefix-cache hit on the wrong page: each changes what is read back, so the tokens differ from `reference`, which
applies `next_token` to the true context. Writes into a page another sequence also holds are refused outright:
shared (prefix-cached) pages are read-only.
"""

import dataclasses

from cbjax.core.request import PENDING_TOKEN
from cbjax.core.runner_contract import check_warmup_mode
from cbjax.core.scheduler import Scheduler
from cbjax.core.scheduler_output import SchedulerOutput


def next_token(context: tuple, vocab_size: int) -> int:
    h = 0
    for token, pos in context:
        h = (h * 1_000_003 + token * 31 + pos) % 2**61
    return h % vocab_size


def reference(prompt: list[int], max_tokens: int, vocab_size: int, eos: int | None, max_model_len: int) -> list[int]:
    """The tokens a correct engine generates for `prompt` (greedy; stops on eos, max_tokens or max_model_len)."""
    ctx, out = list(prompt), []
    while True:
        t = next_token(tuple((tok, i) for i, tok in enumerate(ctx)), vocab_size)
        out.append(t)
        ctx.append(t)
        if t == eos or len(out) >= max_tokens or len(ctx) >= max_model_len:
            return out


def assert_reference_outputs(reqs: dict, expected: dict, sched: Scheduler, num_pages: int) -> None:
    """Every request of `reqs` (request id -> (Request, anything)) finished with its `expected` tokens (an aborted one
    with a prefix of them), and every page went back to the pool."""
    for rid, (r, _) in reqs.items():
        assert r.is_finished
        if r.finish_reason.value == "abort":
            assert r.output_token_ids == expected[rid][: len(r.output_token_ids)]
        else:
            assert r.output_token_ids == expected[rid], rid
    assert sched.pool.num_free == num_pages, "page leak"


def block_rows(out: SchedulerOutput, first: list, kv: dict, page_size: int, vocab_size: int, sched=None) -> list:
    """A block of decode steps (cbjax/core/multi_step.py) as the device runs it, given its first step's tokens
    `first`: in each further step every sequence writes its previous token's K/V at its next position of the fake
    `kv` ((page, offset) -> (token, position)) and samples from its context; -3 past its steps (never read). With
    `sched`, a write into a shared page fails. Returns a row of tokens per step."""
    G, rows = page_size, [first]
    for i in range(1, out.num_steps):
        row = []
        for seq, prev in zip(out.seqs, rows[-1]):
            if i >= seq.num_steps:
                row.append(-3)
                continue
            r, pos = seq.request, seq.num_computed_tokens + i
            page = r.pages[pos // G]
            if sched is not None:
                assert sched.pool.refcount(page) == 1, f"{r.request_id} writes into shared page {page}"
            kv[page, pos % G] = (prev, pos)
            ctx = tuple(kv.get((r.pages[p // G], p % G)) for p in range(pos + 1))
            row.append(next_token(ctx, vocab_size) if None not in ctx else -2)
        rows.append(row)
    return rows


@dataclasses.dataclass
class FakeStepHandle:
    """A step the fake runner has run (at dispatch: there is no device to wait for)."""

    out: SchedulerOutput
    tokens: list
    padded_tokens: int = 0
    swap_s: float = 0.0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    wait_s: float = 0.0


class FakeRunner:
    """Keeps the runner contract (cbjax/core/runner_contract.py): the engine could run on it."""

    advances_clock = False
    num_compiles = 0  # it compiles nothing
    BYTES_PER_PAGE = 1  # what a swapped page counts for in the byte totals
    # False: a swap-in consumes its host page (swap preemption); True: it copies it (runner/kv_swap.py keeps its
    # host arrays, so the prefix cache's host tier can bring a page back twice).
    KEEPS_HOST_PAGES = False

    def __init__(self, scheduler: Scheduler, vocab_size: int):
        self.sched = scheduler
        self.G = scheduler.cache.page_size
        self.vocab_size = vocab_size
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}
        self.host: dict[tuple[int, int], tuple[int, int]] = {}
        self.pages_swapped_out = 0
        self.pages_swapped_in = 0
        # What the previous step sampled, by request: the value of a pending token, as the real runner feeds it
        # in on the device (asynchronous scheduling).
        self.last_sampled: dict[str, int] = {}
        self.swap_out_bytes_total = self.swap_in_bytes_total = 0

    def warmup(self, mode: str = "full") -> float:
        check_warmup_mode(mode)
        return 0.0

    def wait_until_warm(self) -> None:
        return None

    def dispatch(self, out: SchedulerOutput) -> FakeStepHandle:
        swap_s, out_bytes, in_bytes = self.swap(out.swap_out, out.swap_in)
        tokens = self._run(out)
        return FakeStepHandle(out, tokens, out.num_batched_tokens, swap_s, out_bytes, in_bytes)

    def fetch(self, handle: FakeStepHandle) -> list:
        return handle.tokens

    def execute(self, out: SchedulerOutput) -> list:
        return self.fetch(self.dispatch(out))

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> tuple[float, int, int]:
        """Moves the fake KV entries of each page: every swap-out first, then every swap-in."""
        G = self.G
        # A device page may be swapped out twice in one step (two victims sharing a cached prefix page); each copy
        # goes to its own host page.
        host_pages = [h for _, h in swap_out]
        assert len(set(host_pages)) == len(host_pages), "a host page written twice in one step"
        for dev, host in swap_out:
            for o in range(G):
                self.host[host, o] = self.kv.get((dev, o))
        for host, dev in swap_in:
            for o in range(G):
                # A swap-in frees its host copy, unless host pages are kept (the prefix cache's inclusive host tier).
                src = (host, o)
                self.kv[dev, o] = self.host[src] if self.KEEPS_HOST_PAGES else self.host.pop(src)
        self.pages_swapped_out += len(swap_out)
        self.pages_swapped_in += len(swap_in)
        out_bytes, in_bytes = len(swap_out) * self.BYTES_PER_PAGE, len(swap_in) * self.BYTES_PER_PAGE
        self.swap_out_bytes_total += out_bytes
        self.swap_in_bytes_total += in_bytes
        return 0.0, out_bytes, in_bytes

    def _run(self, out: SchedulerOutput) -> list:
        """Write the step's tokens into the fake KV, then read each sampling sequence's context back."""
        G = self.G
        # The pages this step's sequences hold, to check that nobody writes a page someone else reads.
        holders: dict[int, int] = {}
        for seq in out.seqs:
            for p in seq.request.pages:
                holders[p] = holders.get(p, 0) + 1
        for seq in out.seqs:
            r, c, k = seq.request, seq.num_computed_tokens, seq.num_new_tokens
            for pos in range(c, c + k):
                page = r.pages[pos // G]
                assert self.sched.pool.refcount(page) == 1 and holders[page] == 1, (
                    f"{r.request_id} writes position {pos} into shared page {page}"
                )
                token = r.all_token_ids[pos]
                if token == PENDING_TOKEN:
                    token = self.last_sampled[r.request_id]
                self.kv[page, pos % G] = (token, pos)
        tokens = []
        for seq in out.seqs:
            r, n = seq.request, seq.num_computed_tokens + seq.num_new_tokens
            ctx = tuple(self.kv.get((r.pages[p // G], p % G)) for p in range(n))
            tokens.append(next_token(ctx, self.vocab_size) if None not in ctx else -2)
        self.last_sampled = {seq.request.request_id: t for seq, t in zip(out.seqs, tokens) if seq.samples_token}
        if out.num_steps == 1:
            return tokens
        rows = block_rows(out, tokens, self.kv, G, self.vocab_size, self.sched)
        for j, seq in enumerate(out.seqs):
            if seq.num_steps > 1:  # its last step's token is the one its next step reads
                self.last_sampled[seq.request.request_id] = rows[seq.num_steps - 1][j]
        return rows
