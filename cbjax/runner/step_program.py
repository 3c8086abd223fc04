"""The step program: one jitted forward pass over a step's flat batch of tokens, then the LM head and sampling (or
the verification of drafts) on each sequence's last token; or a block of decode steps in a device loop. The
ModelRunner lowers and compiles one per token bucket and kind (compilation/program_family.py)."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cbjax.model.llama import AttentionMetadata
from cbjax.runner.decode_loop import decode_block
from cbjax.runner.flat_input import InputLayout
from cbjax.runner.head_sample import head_and_sample
from cbjax.runner.speculation.draft_proposals import propose_drafts, row_draft_probs, with_drafts
from cbjax.runner.speculation.verification import head_and_verify


@functools.partial(
    jax.jit,
    static_argnames=(
        "layout",
        "graphdef",
        "backend",
        "interpret",
        "mesh",
        "speculation",
        "draft_graphdef",
        "decode_steps",
        "stream_target",
    ),
    donate_argnames=("kv_caches", "draft_kv"),
)
def step_program(
    params,
    kv_caches,
    ints,
    floats,
    verify_rows,
    prev_tokens,
    draft_params=None,
    draft_kv=None,
    stream_meta=None,
    *,
    layout: InputLayout,
    graphdef,
    backend: str,
    interpret: bool,
    mesh=None,
    speculation=None,
    draft_graphdef=None,
    decode_steps: int = 1,
    stream_target: str | None = None,
):
    """params: the model state's leaves; graphdef: interned (GraphDef, state treedef); (ints, floats, verify_rows):
    the step's input as `layout` flattened it (flat_input.py); prev_tokens: the previous step's sampled tokens
    [max_num_seqs], still on the device. Returns this step's, padded the same way.
    With `speculation`: tokens are [max_num_seqs, K + 2] per slot (speculation/verification.py); column 0 feeds the
    pending tokens of the next step. With a draft model too (`draft_graphdef`, its params and KV): the drafts are
    proposed here first (draft_proposals.py) and the draft's KV comes back as a third output. With
    `decode_steps` > 1: a block of that many decode steps (decode_loop.py); its tokens are
    ([decode_steps, max_num_seqs], the last step's [max_num_seqs]); with `stream_target` (token_stream.py) each
    step's are also written to the host as it ends, where `stream_meta` [5] int32 says (its zeros: not).
    A plain step (neither) returns (tokens, sample_hidden, kv): sample_hidden [S, D] holds the final hidden state
    of each slot's last token, which the sampling extras (sampling_extras.py) turn into the logits of the rows that
    ask for logprobs, penalties or masks, in a program of their own (the plain step pays one small output)."""
    max_drafts = None if speculation is None else speculation.max_drafts
    model, inp, token_ids, probs, draft_kv = step_tokens(
        params, kv_caches, ints, floats, verify_rows, prev_tokens, draft_params, draft_kv, layout, graphdef,
        backend, interpret, max_drafts, draft_graphdef,
    )  # fmt: skip
    draft_probs = None if probs is None else functools.partial(row_draft_probs, inp, probs)
    if decode_steps > 1:
        run = lambda ids, positions, kv, md: model(ids, positions, kv, md, backend, interpret, mesh)
        stream = None if stream_target is None else (stream_target, stream_meta)
        rows, last, kv_caches = decode_block(
            model, kv_caches, inp, token_ids, decode_steps, prev_tokens.shape[0], run, stream
        )
        tokens = (rows, last)  # (a slot with fewer steps has its final token pending: nothing reads its `last`)
        if mesh is not None:
            tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, PartitionSpec()))
        return tokens, kv_caches
    md = AttentionMetadata(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
    hidden, kv_caches = model(token_ids, inp.positions, kv_caches, md, backend, interpret, mesh)
    sample_hidden = None
    if speculation is None:
        tokens = head_and_sample(model, hidden, inp)
        sample_hidden = hidden[inp.sample_idx]
    else:
        tokens = head_and_verify(model, hidden, inp, token_ids, speculation.rule, speculation.max_drafts, draft_probs)
    tokens = jnp.zeros((prev_tokens.shape[0], *tokens.shape[1:]), jnp.int32).at[: tokens.shape[0]].set(tokens)
    if mesh is not None:  # every device (and every process) holds all of them: the host reads its own copy
        tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, PartitionSpec()))
        if sample_hidden is not None:
            sample_hidden = jax.lax.with_sharding_constraint(sample_hidden, NamedSharding(mesh, PartitionSpec()))
    if sample_hidden is not None:
        return tokens, sample_hidden, kv_caches
    return (tokens, kv_caches) if draft_graphdef is None else (tokens, kv_caches, draft_kv)


def step_tokens(
    params, kv_caches, ints, floats, verify_rows, prev_tokens, draft_params, draft_kv, layout, graphdef,
    backend, interpret, max_drafts, draft_graphdef, first_allowed=None,
):  # fmt: skip
    """Inside a step's jit: the model, the step's input and its token ids (the previous step's sampled tokens
    filled in; with a draft model, its proposals written after each verify row's context, `first_allowed` the mask
    each slot's first draft is drawn under). Returns (model, inp, token_ids, draft probs q or None, draft_kv)."""
    module_def, treedef = graphdef.value
    model = nnx.merge(module_def, jax.tree.unflatten(treedef, params))
    inp = layout.unflatten(ints, floats, verify_rows, to_uint32=lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32))
    token_ids = jnp.where(inp.token_src >= 0, prev_tokens[jnp.maximum(inp.token_src, 0)], inp.token_ids)
    probs = None
    if draft_graphdef is not None:
        draft_def, draft_treedef = draft_graphdef.value
        draft = nnx.merge(draft_def, jax.tree.unflatten(draft_treedef, draft_params))
        G = kv_caches[0][0].shape[2]
        drafts, probs, draft_kv = propose_drafts(
            draft, draft_kv, token_ids, inp, max_drafts, G, backend, interpret, first_allowed
        )
        token_ids = with_drafts(token_ids, inp, drafts)
    return model, inp, token_ids, probs, draft_kv
