"""The jitted program of a speculative block (speculative_block.py): the step's input as the other step programs take
it (step_program.py), plus each slot's token history and budget. One program per decode token bucket."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from cbjax.runner.flat_input import InputLayout
from cbjax.runner.speculation.speculative_block import BlockShape, speculative_block
from cbjax.runner.step_program import step_tokens


@functools.partial(
    jax.jit,
    static_argnames=("layout", "graphdef", "backend", "interpret", "mesh", "rule", "shape"),
    donate_argnames=("kv_caches",),
)
def speculative_block_program(
    params,
    kv_caches,
    ints,
    floats,
    verify_rows,
    prev_tokens,
    history,
    budgets,
    *,
    layout: InputLayout,
    graphdef,
    backend: str,
    interpret: bool,
    mesh=None,
    rule,
    shape: BlockShape,
):
    """As step_program (its first six arguments), with history [S, L] and budgets [S] int32. Returns (results
    [max_num_seqs, shape.row_width] int32, kv_caches)."""
    model, inp, token_ids, _, _ = step_tokens(
        params, kv_caches, ints, floats, verify_rows, prev_tokens, None, None, layout, graphdef, backend, interpret,
        None, None,
    )  # fmt: skip
    run = lambda ids, positions, kv, md: model(ids, positions, kv, md, backend, interpret, mesh)
    rows, kv_caches = speculative_block(model, kv_caches, inp, token_ids, history, budgets, shape, rule, run)
    results = jnp.zeros((prev_tokens.shape[0], shape.row_width), jnp.int32).at[: rows.shape[0]].set(rows)
    if mesh is not None:
        results = jax.lax.with_sharding_constraint(results, NamedSharding(mesh, PartitionSpec()))
    return results, kv_caches
