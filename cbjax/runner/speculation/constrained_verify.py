"""Verification of a speculative step that holds structured-output requests: every verify row of a constrained
sequence samples under its grammar's mask at that row.

The mask of row i of a sequence is the grammar's state after its committed outputs and its drafts[:i]; only the
host's constraint knows it, and with a draft model the drafts exist only on the device once the draft has run. So
such a step runs in two programs, and a step without a constrained row never sees either (it runs the plain
verifying program, unchanged):

1. `forward_for_rows`: the verifying step's forward (the draft model's proposals first, as step_program.py does,
   each constrained slot's first draft drawn under its grammar's mask at the committed outputs), which returns the
   final hidden states [T, D], the step's tokens with the drafts in place [T] and the draft's distributions
   q [S, K, V] (draft model) instead of verifying.
2. On the host (`verify_masks`): each constrained sequence's drafts walked through its constraint, one bitmask per
   row (fill_bitmask, then accept the row's draft), stopping at the first draft the grammar refuses, then rolled
   back to the committed state. Unconstrained rows, and rows after a refused draft (never reached: the refused
   draft has probability 0 under the mask, so it is rejected), stay all-ones.
3. `masked_verify`: the LM head on the verify rows, the masks, and the acceptance rule (acceptance.py) on the
   masked logits: greedy rows compare each draft with the masked argmax; sampled rows (sample-and-match or
   rejection sampling) draw from, and accept against, the masked target distribution.

Why a variant and not a bitmask input of every verifying program: an unconstrained step would carry R x V/32 words
(5 MB at R = 320, V = 128k) and the mask's work for nothing, and keep the draft's q alive past its step. The
variant costs only the steps that hold a constrained row: the LM head twice on their rows' hidden states (the
forward is not repeated) and, with a draft model, a wait for the drafts before the masks can be made. With
compilation.sampling_extras the variant is compiled at warmup for every token bucket (as the extras programs are);
otherwise on the first step that needs it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.model.llama import AttentionMetadata
from cbjax.runner.flat_input import flat_input
from cbjax.runner.speculation.draft_proposals import row_draft_probs
from cbjax.runner.speculation.verification import Speculation, head_and_verify
from cbjax.runner.step_program import step_tokens


@functools.partial(
    jax.jit,
    static_argnames=("layout", "graphdef", "backend", "interpret", "mesh", "max_drafts", "draft_graphdef"),
    donate_argnames=("kv_caches", "draft_kv"),
)
def forward_for_rows(
    params,
    kv_caches,
    ints,
    floats,
    verify_rows,
    prev_tokens,
    draft_params=None,
    draft_kv=None,
    first_allowed=None,
    *,
    layout,
    graphdef,
    backend: str,
    interpret: bool,
    mesh=None,
    max_drafts: int,
    draft_graphdef=None,
):
    """A verifying step's forward (arguments as step_program's; `first_allowed` [S, ceil(V / 32)]: the mask each
    slot's first draft is drawn under) -> ((hidden [T, D], tokens [T], q [S, K, V] or None), kv_caches[, draft_kv])."""
    model, inp, token_ids, probs, draft_kv = step_tokens(
        params, kv_caches, ints, floats, verify_rows, prev_tokens, draft_params, draft_kv, layout, graphdef,
        backend, interpret, max_drafts, draft_graphdef, first_allowed,
    )  # fmt: skip
    md = AttentionMetadata(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
    hidden, kv_caches = model(token_ids, inp.positions, kv_caches, md, backend, interpret, mesh)
    rows = (hidden, token_ids, probs)
    return (rows, kv_caches) if draft_graphdef is None else (rows, kv_caches, draft_kv)


@functools.partial(jax.jit, static_argnames=("graphdef", "speculation", "num_slots"))
def masked_verify(params, hidden, token_ids, probs, inp, allowed, *, graphdef, speculation: Speculation, num_slots):
    """head_and_verify with each verify row's logits masked by `allowed` [R, ceil(V / 32)] int32 -> the verifying
    step's tokens [num_slots, K + 2] (verification.py's layout)."""
    module_def, treedef = graphdef.value
    model = nnx.merge(module_def, jax.tree.unflatten(treedef, params))
    draft_probs = None if probs is None else functools.partial(row_draft_probs, inp, probs)
    tokens = head_and_verify(
        model, hidden, inp, token_ids, speculation.rule, speculation.max_drafts, draft_probs, allowed=allowed
    )
    return jnp.zeros((num_slots, tokens.shape[1]), jnp.int32).at[: tokens.shape[0]].set(tokens)


def verify_masks(seqs, order, verify, row_drafts: np.ndarray, num_words: int) -> np.ndarray:
    """The bitmask of every verify row [R, num_words] int32 (see the module docstring). `verify`: the step's
    VerifyRows (host); `row_drafts` [R]: the draft each row checks (-1: none), as the device will read it. Leaves
    every constraint in the state it had (its committed outputs)."""
    allowed = np.full((verify.row_idx.shape[0], num_words), -1, np.int32)
    for i, j in enumerate(order):
        s = seqs[j]
        constraint = s.request.constraint
        if constraint is None or not s.samples_token:
            continue
        start, d = int(verify.slot_row_start[i]), int(verify.slot_num_drafts[i])
        taken = 0
        try:
            for row in range(start, start + d + 1):
                constraint.fill_bitmask(allowed[row])
                draft = int(row_drafts[row])
                if row == start + d or not (int(allowed[row, draft >> 5]) >> (draft & 31)) & 1:
                    break  # the bonus row, or a draft the grammar refuses (rejected by the mask itself)
                constraint.accept([draft])
                taken += 1
        finally:
            constraint.rollback(taken)
    return allowed


class ConstrainedVerifier:
    """The two programs of a constrained verifying step for one ModelRunner, and their warmup."""

    def __init__(self, *, graphdef, speculation: Speculation, backend, interpret, mesh, vocab_size, compiles):
        self.graphdef, self.speculation, self.compiles = graphdef, speculation, compiles
        self.backend, self.interpret, self.mesh = backend, interpret, mesh
        self.num_words = -(-vocab_size // 32)
        self.num_steps = 0  # verifying steps that ran the masked path (for tests)

    @staticmethod
    def needed(seqs) -> bool:
        return any(s.request.constraint is not None for s in seqs)

    def run(self, params, kv_caches, draft, inp, prev_tokens, seqs, order):
        """One constrained verifying step (inp: its StepInput or FlatStepInput, verify rows included) -> (tokens
        [max_num_seqs, K + 2] on the device, kv_caches). The draft's KV (`draft`: a DraftRunner or None) is
        updated in place."""
        flat = flat_input(inp)
        first = None if draft is None else self._first_masks(seqs, order, flat.layout.S)
        (hidden, token_ids, probs), kv_caches = self._forward(params, kv_caches, draft, flat, prev_tokens, first)
        inp = flat.unflatten()  # (host arrays)
        v = inp.verify
        # n-gram drafts are the host's own tokens; a draft model's exist only on the device (one small wait).
        tokens = inp.token_ids if draft is None else np.asarray(token_ids)
        T = tokens.shape[0]
        row_drafts = np.where(v.row_draft >= 0, tokens[np.minimum(v.row_idx + 1, T - 1)], -1)
        allowed = verify_masks(seqs, order, v, row_drafts, self.num_words)
        self.num_steps += 1
        return self._verify(params, hidden, token_ids, probs, inp, allowed, prev_tokens.shape[0]), kv_caches

    def warmup(self, params, kv_caches, draft, inputs, prev_tokens):
        """Compile (and run once, on all-padding `inputs`, one per token bucket: their KV writes go to the spare
        page) both programs of every bucket. Returns the KV caches."""
        for inp in inputs:
            flat = flat_input(inp)
            first = None if draft is None else np.full((flat.layout.S, self.num_words), -1, np.int32)
            (hidden, token_ids, probs), kv_caches = self._forward(params, kv_caches, draft, flat, prev_tokens, first)
            allowed = np.full((inp.verify.row_idx.shape[0], self.num_words), -1, np.int32)
            jax.block_until_ready(self._verify(params, hidden, token_ids, probs, inp, allowed, prev_tokens.shape[0]))
        return kv_caches

    def _first_masks(self, seqs, order, S: int) -> np.ndarray:
        """[S, words]: each constrained slot's mask at its committed outputs, which its first draft is drawn under
        (a draft model that does not know the grammar otherwise often proposes a refused token first). All-ones
        for the other slots."""
        first = np.full((S, self.num_words), -1, np.int32)
        for i, j in enumerate(order):
            constraint = seqs[j].request.constraint
            if constraint is not None and seqs[j].samples_token:
                constraint.fill_bitmask(first[i])
        return first

    def _forward(self, params, kv_caches, draft, flat, prev_tokens, first_allowed=None):
        kinds = dict(
            layout=flat.layout,
            graphdef=self.graphdef,
            backend=self.backend,
            interpret=self.interpret,
            mesh=self.mesh,
            max_drafts=self.speculation.max_drafts,
        )
        args = (params, kv_caches, flat.ints, flat.floats, flat.verify, prev_tokens)
        with self.compiles.counting():
            if draft is None:
                return forward_for_rows(*args, **kinds)
            rows, kv_caches, draft.kv_caches = forward_for_rows(
                *args, draft.params, draft.kv_caches, first_allowed, draft_graphdef=draft.graphdef, **kinds
            )
        return rows, kv_caches

    def _verify(self, params, hidden, token_ids, probs, inp, allowed, num_slots):
        with self.compiles.counting():
            return masked_verify(
                params,
                hidden,
                token_ids,
                probs,
                inp,
                allowed,
                graphdef=self.graphdef,
                speculation=self.speculation,
                num_slots=num_slots,
            )
