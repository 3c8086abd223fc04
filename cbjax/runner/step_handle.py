"""StepHandle: a step the runner has dispatched, its tokens still on the device until the runner fetches them."""

import dataclasses

import jax

from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.runner.flat_input import FlatStepInput


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: what it ran and what it cost; its tokens stay on the device until `fetch`. (It keeps the
    fields of cbjax.core.runner_contract.StepHandle.)"""

    out: SchedulerOutput
    tokens: jax.Array | None  # [max_num_seqs] int32 on the device (None: a swap-only step)
    order: list[int]  # slot i holds out.seqs[order[i]]
    padded_tokens: int = 0  # the token bucket
    swap_s: float = 0.0  # wall time of the step's KV copies (they finish before dispatch returns)
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    wait_s: float = 0.0  # how long fetch waited for the device
    # A speculative step: tokens are [max_num_seqs, K + 2] (cbjax/runner/speculation/verification.py).
    verified: bool = False
    inp: FlatStepInput | None = None  # the packed input the step ran (None: a swap-only step)
    extras: object = None  # the sampling extras' outputs still on the device (extras_runner.ExtrasHandle)
    # A block whose rows stream (token_stream.py): its first position, the rows taken by `fetch_row` so far (fetch
    # returns the rest), the seconds those waited for the device, and the engine's host seconds taking them.
    stream_base: int | None = None
    rows_received: int = 0
    row_wait_s: float = 0.0
    row_host_s: float = 0.0
    stop_requested: bool = False  # asked to end early (a request arrived: TokenStream.request_stop)
    row_order: object = None  # numpy gather from a row's slots to out.seqs order; None: the identity
