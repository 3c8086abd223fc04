"""FlatStepInput: a StepInput as the step programs take it, every int32 field in one buffer and the float32 ones
in another (the verify rows of a speculative step stay apart).

Each argument of a program call costs its launch host time on XLA:CPU (converting a numpy array, checking its
layout, tracking its buffer), and the step's 15 input arrays were 15 such arguments; two buffers are two. The
program slices the fields back out (InputLayout.unflatten, traced: static slices of a few KB). The flat int32
buffer also lets the packer advance a steady decode batch with one add (cbjax/runner/step_packer.py). What it
gave: docs/benchmarks.md, "Host time at 64 running sequences" (`experiments.throughput --host_split`).
"""

import dataclasses
import functools
import typing

import numpy as np

from cbjax.runner.speculation.verify_rows import VerifyRows
from cbjax.runner.step_input import StepInput

# The int32 buffer's fields, in order (seeds are uint32: their bits ride in the int32 buffer).
INT_FIELDS = (
    "token_ids",
    "token_src",
    "positions",
    "slot_mapping",
    "kv_lens",
    "page_indices",
    "cu_q_lens",
    "num_seqs",
    "sample_idx",
    "top_k",
    "seeds",
    "counters",
    "decode_steps",  # only in a block of decode steps
)
FLOAT_FIELDS = ("temperature", "top_p")


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """Where each field lies in the two buffers, for token bucket T, S slots, page tables W wide, and whether the
    step is a block of decode steps (it then has decode_steps). Static (hashable): part of the program's key."""

    T: int
    S: int
    W: int
    blocks: bool = False

    def shape(self, name: str) -> tuple[int, ...]:
        T, S = self.T, self.S
        sizes = {"token_ids": T, "token_src": T, "positions": T, "slot_mapping": T, "cu_q_lens": S + 1, "num_seqs": 1}
        return (S, self.W) if name == "page_indices" else (sizes.get(name, S),)

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Each field's first element in its buffer."""
        out, at = {}, {"i": 0, "f": 0}
        for name in self.int_fields + FLOAT_FIELDS:
            kind = "f" if name in FLOAT_FIELDS else "i"
            out[name] = at[kind]
            at[kind] += int(np.prod(self.shape(name)))
        out["_num_ints"], out["_num_floats"] = at["i"], at["f"]
        return out

    @property
    def int_fields(self) -> tuple[str, ...]:
        return INT_FIELDS if self.blocks else INT_FIELDS[:-1]

    @property
    def num_ints(self) -> int:
        return self.offsets["_num_ints"]

    def field(self, buffer, name: str):
        """One field of a buffer (numpy: a view; traced: a static slice)."""
        at, shape = self.offsets[name], self.shape(name)
        return buffer[at : at + int(np.prod(shape))].reshape(shape)

    def flatten(self, inp: StepInput) -> "FlatStepInput":
        ints = np.concatenate([np.asarray(getattr(inp, n)).reshape(-1).view(np.int32) for n in self.int_fields])
        floats = np.concatenate([getattr(inp, n) for n in FLOAT_FIELDS]).astype(np.float32, copy=False)
        return FlatStepInput(ints, floats, self, inp.verify)

    def unflatten(self, ints, floats, verify=None, to_uint32=lambda x: x.view(np.uint32)) -> StepInput:
        """The StepInput whose fields are the buffers' slices (`to_uint32` reinterprets the seeds' bits: a numpy
        view by default; in a traced program jax.lax.bitcast_convert_type)."""
        fields = {n: self.field(ints, n) for n in self.int_fields}
        fields |= {n: self.field(floats, n) for n in FLOAT_FIELDS}
        fields["seeds"] = to_uint32(fields["seeds"])
        return StepInput(**fields, verify=verify)


def layout_of(inp: StepInput) -> InputLayout:
    return _layout(
        inp.token_ids.shape[0], inp.kv_lens.shape[0], inp.page_indices.shape[1], inp.decode_steps is not None
    )


@functools.lru_cache(maxsize=256)
def _layout(T: int, S: int, W: int, blocks: bool) -> InputLayout:
    return InputLayout(T, S, W, blocks)  # one object per shape: its offsets are computed once


class FlatStepInput(typing.NamedTuple):
    ints: np.ndarray  # [layout.num_ints] int32
    floats: np.ndarray  # [2 S] float32
    layout: InputLayout
    verify: VerifyRows | None = None

    @property
    def num_tokens(self) -> int:  # the token bucket T
        return self.layout.T

    def unflatten(self) -> StepInput:
        return self.layout.unflatten(self.ints, self.floats, self.verify)


def flat_input(inp: "StepInput | FlatStepInput") -> FlatStepInput:
    return inp if isinstance(inp, FlatStepInput) else layout_of(inp).flatten(inp)
