"""The structured-output oracle: greedy decoding with the plain full-sequence forward (no cache, no engine), each
row's logits masked by its constraint before the argmax, as the engine's sampler must mask them."""

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.core.structured_outputs import TokenConstraint

_FWD_CACHE = {}


def allowed_tokens(constraint: TokenConstraint, vocab_size: int) -> np.ndarray:
    """The constraint's mask as bool [V]."""
    row = np.zeros(-(-vocab_size // 32), np.int32)
    constraint.fill_bitmask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def constrained_greedy(
    model, prompts: list[list[int]], constraints: list[TokenConstraint], max_tokens: int, eos_token_id: int
) -> list[list[int]]:
    """Each prompt's greedy output under its constraint (None: unconstrained), up to its EOS or max_tokens. All
    rows in one padded batch, recomputed from scratch at every position (causal attention makes the padding after
    each row harmless)."""
    fwd = _FWD_CACHE.get(id(model)) or _FWD_CACHE.setdefault(id(model), jax.jit(model.forward_full))
    vocab = model.cfg.vocab_size
    n, width = len(prompts), max(len(p) for p in prompts) + max_tokens
    toks = np.zeros((n, width), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    outs: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_tokens):
        logits = np.asarray(fwd(jnp.asarray(toks))[np.arange(n), lens - 1], np.float32)
        for i in range(n):
            if done[i]:
                continue
            row = logits[i]
            if constraints[i] is not None:
                row = np.where(allowed_tokens(constraints[i], vocab), row, -np.inf)
            token = int(np.argmax(row))
            if constraints[i] is not None:
                constraints[i].accept([token])
            outs[i].append(token)
            toks[i, lens[i]] = token
            lens[i] += 1
            done[i] = token == eos_token_id or len(outs[i]) == max_tokens
        if all(done):
            break
    return outs
