"""The request of a workload, before it reaches the engine, and what every generator and loader shares: default
vocabulary bounds, the long/short classes, random token ids and the seeded random streams."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cbjax.bench.fields import as_int

LENGTH_CLASSES = ("short", "long")
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_LOW_ID = 3
DEFAULT_LONG_THRESHOLD = 1024

Tokenize = Callable[[str], Sequence[int]]


class Stream(enum.IntEnum):
    """One independent random stream per concern, so e.g. a new request_rate does not reshuffle the lengths."""

    ARRIVAL = 0
    PROMPT = 1
    OUTPUT = 2
    TOKENS = 3
    MIX = 4
    PREFIX = 5
    TURNS = 6  # sessions: turns per session
    THINK = 7  # sessions: think times between turns
    MESSAGE = 8  # sessions: lengths of the later turns' messages


def rng_for(seed: int, stream: Stream) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, int(stream)]))


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload, before it reaches the engine.

    `prompt_token_ids` is what the engine runs. `prompt` keeps the text when the source held text and no ids;
    the ids are then `tokenize(prompt)` if a tokenizer was given to the loader, else placeholder ids of the
    estimated length (`approx_num_tokens`), which is what a random-init model needs.
    `deadline` is absolute, in seconds from the start of the run, like `arrival_time`.

    Multi-turn sessions (cbjax/bench/sessions.py): the turns of one conversation share `session_id` and are numbered
    by `turn` from 0. Turn 0 is an ordinary request. A later turn's `prompt_token_ids` hold only its new user
    message: its prompt is the previous turn's prompt + the tokens the engine generated for it + this message,
    known only once the previous turn finishes, and it arrives `think_time_s` after that (the online loop releases
    it then). Its `arrival_time` in the workload is the earliest it could arrive (the session's start plus the
    think times before it, as if every turn were served instantly).
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    tenant: str = "default"
    priority: int = 0
    deadline: float | None = None
    length_class: str = "short"  # "short" or "long"
    prompt: str | None = None
    session_id: str | None = None  # None: a one-shot request
    turn: int = 0  # 0: the session's first turn (or a one-shot request)
    think_time_s: float = 0.0  # a later turn: the user's pause between the previous answer and this message

    def __post_init__(self) -> None:
        where = f"request {self.request_id!r}"
        if isinstance(self.turn, bool) or not isinstance(self.turn, int) or self.turn < 0:
            raise ValueError(f"{where}: turn must be an integer >= 0, got {self.turn!r}")
        think = self.think_time_s
        if isinstance(think, bool) or not isinstance(think, (int, float)) or not 0 <= think < float("inf"):
            raise ValueError(f"{where}: think_time_s must be a finite number of seconds >= 0, got {think!r}")
        if self.session_id is None and (self.turn or think):
            raise ValueError(f"{where}: turn and think_time_s belong to a session's turns: it needs a session_id")
        if self.turn == 0 and think:
            raise ValueError(f"{where}: a session's first turn arrives by its arrival_time, not after a think time")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def length_class_of(prompt_len: int, max_tokens: int, long_threshold: int = DEFAULT_LONG_THRESHOLD) -> str:
    """ "long" when prompt_len + max_tokens > long_threshold, else "short" (for requests without a preset class)."""
    return "long" if prompt_len + max_tokens > long_threshold else "short"


def random_token_ids(
    rng: np.random.Generator, length: int, vocab_size: int, low_id: int = DEFAULT_LOW_ID
) -> tuple[int, ...]:
    """`length` ids uniform in [low_id, vocab_size), as a tuple of Python ints."""
    return tuple(rng.integers(low_id, vocab_size, size=int(length)).tolist())


def check_vocab(vocab_size: Any, low_id: Any) -> tuple[int, int]:
    vocab_size = as_int(vocab_size, "vocab_size", minimum=1)
    low_id = as_int(low_id, "low_id", minimum=0)
    if low_id >= vocab_size:
        raise ValueError(f"low_id must be < vocab_size, got low_id={low_id}, vocab_size={vocab_size}")
    return vocab_size, low_id
