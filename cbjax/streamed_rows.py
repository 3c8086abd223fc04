"""StreamedRows: the rows of a streaming block of decode steps, handed out as outputs when they arrive and applied
to their requests in one burst, when the block ends.

Why: a streaming block's rows (cbjax/runner/token_stream.py) reach the host one per LLMEngine.step(), each after
a wait of one device step, in which the step's compute has pushed the host's data out of the CPU caches. Applying a
row of 64 tokens to 64 requests (Scheduler.update) then cost ~110 us at 64 sequences of llama-tiny on 2 cores,
where the same work on warm caches costs about a third of that; building the row's 64 outputs ~50 us more
(`experiments.throughput --stream --host_split` while this was built, variants not kept): touching each request per
row was most of a streaming block's host time, whatever the code that did it (writing the tokens alone, with no
times or stop checks, still cost ~90 us a row). Here a row only becomes outputs, built from lists
made once per block (ids, metrics, counts), and the rows are applied to the requests together when the block ends:
the first row's touch of each request is cold, the rest warm.

When: a row is kept aside only while nothing can tell it from an applied one. Every request of the block is plain
(no sample group, no logprobs, no stop strings), no token of the row could stop its request (EOS or a stop id: the
row and every later one go the usual way, after the kept rows are applied), and no sequence of the block reaches
its length limit at that row. Anything that reads a request's tokens meanwhile applies the kept rows first
(`flush`): the block's end, an abort, and reading an output's completion (a RowOutput's `outputs`). What a reader
can see differ: a running request's `metrics.token_times` gains a kept row's time when the rows are applied (as a
block that does not stream gains its rows' at its end).
"""

from cbjax.core.outputs import ReceivedOutput
from cbjax.core.request import RequestStatus

_FINISHED = RequestStatus.FINISHED


class RowOutput(ReceivedOutput):
    """A kept row's output of one request: its new token is held here (the request's own list still has the
    placeholder until the rows are applied); reading its completion applies them first."""

    finish_reason, finished, error, _num_new = None, False, None, 1

    def __init__(self, request, request_id: str, metrics, num_received: int, token: int, complete):
        self._request, self.request_id, self.metrics = request, request_id, metrics
        self._num_received, self._token, self._complete = num_received, token, complete

    def stream_delta(self) -> list[int]:
        return [self._token]


class StreamedRows:
    """The kept rows of one streaming block `out` (a SchedulerOutput whose sequences are plain decodes). Make it
    with `create` at the block's first row; `keep` each row; `flush` before anything reads the requests."""

    def __init__(self, sched, out, eos_token_id, complete):
        """`complete(request, num_received, num_new, finish_reason)`: the engine's completion builder."""
        self.sched, self.out, self.eos_token_id = sched, out, eos_token_id
        self.reqs, self.ids, self.metrics, self.received = reqs, ids, metrics, received = [], [], [], []
        self.stops = stops = set()
        for s in out.seqs:  # (one pass: each request's first touch in a while is a cache miss)
            r = s.request
            reqs.append(r)
            ids.append(r.request_id)
            metrics.append(r.metrics)
            received.append(len(r.output_token_ids) - r.num_pending_tokens)  # before this block's (placeholders)
            if r.params.stop_token_ids:
                stops.update(r.params.stop_token_ids)
        if eos_token_id is not None:
            self.stops.add(eos_token_id)  # (a request that ignores EOS is told apart by the usual way)
        # A row from here on may hold a sequence's last step (its length limit): from there the usual way.
        self.last_kept = min(s.num_steps for s in out.seqs) - 2
        self.rows, self.times, self.first_step = [], [], None
        self._complete = complete

    @classmethod
    def create(cls, sched, out, eos_token_id, builder) -> "StreamedRows | None":
        """Rows for block `out`, or None where a request of it is finished or not plain (`builder`, the engine's
        OutputBuilder, says: `is_plain`); its outputs' completions are the builder's."""
        if any(s.request.status is _FINISHED or not builder.is_plain(s.request) for s in out.seqs):
            return None
        return cls(sched, out, eos_token_id, builder.completion)

    def keep(self, row: list[int], step: int, now: float, build: bool = True) -> list[RowOutput] | None:
        """The outputs of step `step`'s row (its tokens in out.seqs order), kept aside (`build` False: none built,
        an empty list: a bulk reader takes `ids` and the row); None where it cannot be kept (then every row kept so
        far is applied, and the caller applies this one the usual way)."""
        if step > self.last_kept or not self.stops.isdisjoint(row):
            self.flush()
            return None
        if self.first_step is None:
            self.first_step = step
        self.rows.append(row)
        self.times.append(now)
        if not build:
            return []
        k, complete = len(self.rows), self.complete
        return [
            RowOutput(r, rid, m, n + k, t, complete)
            for r, rid, m, n, t in zip(self.reqs, self.ids, self.metrics, self.received, row)
        ]

    def flush(self) -> None:
        """Apply the kept rows to their requests (Scheduler.update, a row at a time with its time)."""
        rows, times, self.rows, self.times = self.rows, self.times, [], []
        sched, out, eos = self.sched, self.out, self.eos_token_id
        for j, (row, now) in enumerate(zip(rows, times), self.first_step or 0):
            sched.update(out, (row,), eos, now, j)
        self.received = [n + len(rows) for n in self.received]
        self.first_step = None

    def complete(self, request, num_received: int, num_new: int, finish_reason):
        """A RowOutput's completion, built when read: the kept rows applied first."""
        if self.rows:
            self.flush()
        return self._complete(request, num_received, num_new, finish_reason)
