"""Type and range checks for user-facing options, one message shape for all of them.

Every public option (EngineConfig, SamplingParams, add_request's arguments, policy options) goes through these,
so a typo is a ValueError that names the option, the value and what is allowed, raised before anything is compiled
or queued. Each checker returns the value normalised to a plain Python type (numpy integers and floats are
welcome and become int / float); bools are never accepted as numbers, floats never as integers, NaN and
infinities never as sizes, fractions or times.
"""

import math
import numbers
from collections.abc import Collection, Mapping, Sequence

import numpy as np


def _shown(value) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _range_text(kind: str, low, high, low_open: bool, high_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    return kind + (" " + " and ".join(parts) if parts else "")


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool."""
    if type(value) is int:  # the common case, without the ABC checks (add_request checks a few per request)
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and not _is_numpy_bool(value)


def _is_numpy_bool(value) -> bool:
    return isinstance(value, np.bool_)


def integer(name: str, value, low: int | None = None, high: int | None = None, *, high_open: bool = False) -> int:
    """An integer in [low, high] ([low, high) with high_open)."""
    if not is_integer(value):
        raise ValueError(
            f"{name} must be {_range_text('an integer', low, high, False, high_open)}, got {_shown(value)}"
        )
    value = int(value)
    if (low is not None and value < low) or (high is not None and (value >= high if high_open else value > high)):
        raise ValueError(f"{name} must be {_range_text('an integer', low, high, False, high_open)}, got {value}")
    return value


def optional_integer(name: str, value, low: int | None = None, high: int | None = None) -> int | None:
    return None if value is None else integer(name, value, low, high)


def real(
    name: str, value, low: float | None = None, high: float | None = None, *, low_open=False, high_open=False
) -> float:
    """A finite number (int or float, not bool) in the given range."""
    kind = "a finite number"
    if type(value) is not float and not (  # a plain float skips the ABC checks
        isinstance(value, numbers.Real) and not isinstance(value, bool) and not _is_numpy_bool(value)
    ):
        raise ValueError(f"{name} must be {_range_text(kind, low, high, low_open, high_open)}, got {_shown(value)}")
    value = float(value)
    bad = not math.isfinite(value)
    bad |= low is not None and (value <= low if low_open else value < low)
    bad |= high is not None and (value >= high if high_open else value > high)
    if bad:
        raise ValueError(f"{name} must be {_range_text(kind, low, high, low_open, high_open)}, got {value}")
    return value


def optional_real(name: str, value, low: float | None = None, high: float | None = None, **kw) -> float | None:
    return None if value is None else real(name, value, low, high, **kw)


def boolean(name: str, value) -> bool:
    if isinstance(value, bool) or _is_numpy_bool(value):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {_shown(value)}")


def choice(name: str, value, choices: Collection):
    """One of `choices` (compared by equality; strings only match strings)."""
    if not isinstance(value, (str, type(None), bool)) or value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices, key=str)}, got {_shown(value)}")
    return value


def text(name: str, value, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ValueError(f"{name} must be a {'' if empty else 'non-empty '}string, got {_shown(value)}")
    return value


def mapping(name: str, value) -> dict:
    """A dict with string keys (None is an empty one)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name} must be a dict with string keys, got {_shown(value)}")
    return dict(value)


def token_ids(name: str, value, vocab_size: int | None = None) -> list[int]:
    """A sequence (list, tuple, 1-D numpy array) of integer token ids, each in [0, vocab_size) when it is known.

    Text, bytes, floats and bools are refused: silently converting them would change the experiment."""
    if isinstance(value, (str, bytes, bytearray)) or not _is_sequence(value):
        raise ValueError(f"{name} must be a sequence of integer token ids, got {_shown(value)}")
    ids = list(value)
    # The common case, plain ints, checked by exact type (an ABC isinstance per token cost ~0.5 ms per 1000-token
    # prompt; the set of types is built in C, a generator over the tokens cost ~4x more); anything else (numpy
    # integers, bools, floats) takes the full check.
    if not set(map(type, ids)) <= {int}:
        bad = [t for t in ids if not is_integer(t)]
        if bad:
            raise ValueError(f"{name} must hold integer token ids; it holds {_shown(bad[0])}")
        ids = [int(t) for t in ids]
    if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
        outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        allowed = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, vocabulary size)"
        raise ValueError(f"{name}: token ids outside {allowed}: {outside[:5]}")
    return ids


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """A prompt's token ids: text (encoded by `tokenizer`, which must exist) or a sequence of integer ids in the
    vocabulary; not empty."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this model has none, pass token ids")
        prompt = tokenizer.encode(prompt)
    tokens = token_ids("prompt", prompt, vocab_size)
    if not tokens:
        raise ValueError("empty prompt")
    return tokens


def _is_sequence(value) -> bool:
    if type(value) in (list, tuple) or isinstance(value, Sequence):  # (exact types first: no ABC check)
        return True
    # numpy arrays are not registered as Sequences; one dimension only (a 2-D array is a batch, not a prompt).
    return getattr(value, "ndim", None) == 1 and hasattr(value, "tolist")
