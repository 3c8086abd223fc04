"""The LM head and verification of a speculative step, inside the jitted step (cbjax/runner/model_runner.py).

Output per slot: [K + 2] int32 = the accepted drafts, then one sampled token, then padding, and in the last column
the number of valid tokens (accepted + 1). A slot without drafts gets its one sampled token (count 1).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.runner.sampling_extras import unpack_bitmask
from cbjax.runner.speculation.acceptance import first_rejection

# The LM head runs on the first `tier` rows, the smallest tier that holds the step's live rows (one compiled program
# per token bucket, the tiers are branches inside it): a decode step of a few sequences does not pay for R rows.
ROW_TIERS = (32, 128)


@dataclasses.dataclass(frozen=True)
class Speculation:
    """Static: the step verifies up to `max_drafts` drafts per sequence with acceptance `rule` (acceptance.py);
    `device_lookup` (min_n, max_n): n-gram speculation also runs in blocks on the device with that prompt lookup
    (block_runner.py; None: not)."""

    max_drafts: int
    rule: object
    device_lookup: tuple[int, int] | None = None


def head_and_verify(model, hidden, inp, token_ids, rule, max_drafts: int, draft_probs=None, allowed=None):
    """hidden [T, D] -> [S, K + 2] int32 (see the module docstring). `token_ids`: the step's flat tokens as the
    model computed them (drafts a draft model proposed on the device included: each row's draft is read from
    there, the host's `row_draft` only says which rows have one); `draft_probs(rows)`: q at the first `rows` rows
    [rows, V], for a rule that `uses_draft_probs` (a function: the rule computes it only when a row samples);
    `allowed` [R, ceil(V / 32)] int32: each row's token bitmask (structured output, constrained_verify.py), applied
    to its logits before the rule (None: no mask)."""
    v = inp.verify
    R, K, T = v.row_idx.shape[0], max_drafts, token_ids.shape[0]
    row_draft = jnp.where(v.row_draft >= 0, token_ids[jnp.minimum(v.row_idx + 1, T - 1)], -1)

    def rows(r: int):
        slot = v.row_slot[:r]
        logits = model.logits(hidden[v.row_idx[:r]])
        if allowed is not None:
            logits = jnp.where(unpack_bitmask(allowed[:r], logits.shape[1]), logits, -jnp.inf)
        params = (inp.temperature[slot], inp.top_k[slot], inp.top_p[slot], inp.seeds[slot], v.row_counter[:r])
        extra = (functools.partial(draft_probs, r),) if getattr(rule, "uses_draft_probs", False) else ()
        tokens, accepted = rule(logits, row_draft[:r], *params, *extra)
        pad = R - r
        return jnp.pad(tokens.astype(jnp.int32), (0, pad)), jnp.pad(accepted, (0, pad))

    tiers = sorted({min(t, R) for t in ROW_TIERS} | {R})
    if len(tiers) == 1:
        tokens, accepted = rows(R)
    else:
        branch = jnp.searchsorted(jnp.asarray(tiers), v.num_rows[0])
        tokens, accepted = jax.lax.switch(
            jnp.minimum(branch, len(tiers) - 1), [functools.partial(rows, t) for t in tiers]
        )
    j = jnp.arange(K + 1)[None, :]
    idx = jnp.minimum(v.slot_row_start[:, None] + j, R - 1)  # [S, K+1]: each slot's rows
    num_accepted = first_rejection(accepted[idx], v.slot_num_drafts)
    out = jnp.where(j < num_accepted[:, None], row_draft[idx], tokens[idx])
    return jnp.concatenate([out, (num_accepted + 1)[:, None]], axis=1).astype(jnp.int32)
