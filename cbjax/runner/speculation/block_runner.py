"""The runner's part of speculative blocks (cbjax/core/speculation/speculative_blocks.py; the device's side in
speculative_block.py): the program family (one per decode token bucket, built with the others at warmup), the
packing of each slot's token history and budget beside the block's first step, and the results as the scheduler
takes them. The ModelRunner owns one when its speculation has `device_blocks`."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cbjax.core.speculation.speculative_blocks import budgets, is_speculative_block
from cbjax.runner import sharding
from cbjax.runner.compilation.program_family import ProgramFamily
from cbjax.runner.flat_input import flat_input
from cbjax.runner.speculation.block_program import speculative_block_program
from cbjax.runner.speculation.speculative_block import BlockShape, result_columns


class SpeculativeBlocks:
    """Speculative blocks of `iterations` iterations of up to `max_drafts` drafts, for a runner's buckets."""

    def __init__(self, *, lookup: tuple[int, int], iterations: int, max_drafts: int, rule, runner_parts, compiles):
        """`lookup`: the prompt lookup's (min, max) n-gram lengths; `runner_parts`: dict(buckets, graphdef, backend,
        interpret, mesh, global_inputs, avals (params, kv), no_pending (an array like the pending tokens),
        padding_input(T) (a block's all-padding StepInput),
        key(T) (the runner's program key of a block of bucket T))."""
        self.shape = BlockShape(iterations, max_drafts, *lookup)
        self.rule = rule
        p = self.parts = runner_parts
        b = p["buckets"]
        self.history_len = b.pages_per_seq * b.page_size  # >= max_model_len: every context fits
        # A block of n sequences runs in bucket T >= n (K + 1) (the rows of an iteration, speculative_blocks.py).
        top = b.token_bucket(min(b.max_num_seqs * (max_drafts + 1), b.token_buckets[-1]))
        key = lambda T: (*p["key"](T), "speculative_block", self.shape, self.rule)
        self.programs = ProgramFamily([n for n in b.token_buckets if n <= top], self._build, key, compiles)

    runs = staticmethod(is_speculative_block)

    def _static(self, layout) -> dict:
        p = self.parts
        return dict(
            layout=layout,
            graphdef=p["graphdef"],
            backend=p["backend"],
            interpret=p["interpret"],
            mesh=p["mesh"],
            rule=self.rule,
            shape=self.shape,
        )

    def _build(self, T: int):
        p = self.parts
        flat = flat_input(p["padding_input"](T))
        S = p["buckets"].slots(T)
        params, kv_caches = p["avals"]
        ints = jax.ShapeDtypeStruct((S, self.history_len), jnp.int32), jax.ShapeDtypeStruct((S,), jnp.int32)
        args = (params, kv_caches, flat.ints, flat.floats, flat.verify, p["no_pending"], *ints)
        return speculative_block_program.lower(*args, **self._static(flat.layout)).compile()

    def pack(self, out, order: list[int], T: int) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's context (history [S, L]) and budget [S], slot i holding out.seqs[order[i]]."""
        S = self.parts["buckets"].slots(T)
        history = np.zeros((S, self.history_len), np.int32)
        for i, j in enumerate(order):
            req = out.seqs[j].request
            n = req.num_tokens - 1  # (its last output is the block's, pending)
            history[i, :n] = req.all_token_ids[:n]
        limits = np.zeros(S, np.int32)
        limits[: len(order)] = np.asarray(budgets(out), np.int32)[order]
        return history, limits

    def run(self, params, kv_caches, inp, order: list[int], out, pending_tokens):
        """Run the block `out`, packed as `inp` (its first step, a flat decode input); returns (results on the
        device, kv_caches)."""
        flat = flat_input(inp)
        history, budgets = self.pack(out, order, flat.layout.T)
        args = (flat.ints, flat.floats, flat.verify, history, budgets)
        if self.parts["global_inputs"]:
            replicated = NamedSharding(self.parts["mesh"], PartitionSpec())
            args = jax.tree.map(lambda a: sharding.put_global(a, replicated), args)
        ints, floats, verify, history, budgets = args
        program = self.programs.get(flat.layout.T)
        return program(params, kv_caches, ints, floats, verify, pending_tokens, history, budgets)

    def results(self, out, order: list[int], host_rows: np.ndarray) -> list:
        """Per sequence of `out` (in its order): (tokens, drafted per iteration, accepted per iteration)."""
        tokens, count, drafted, accepted = result_columns(self.shape)
        result: list = [None] * len(order)
        for i, j in enumerate(order):
            row = host_rows[i]
            result[j] = (row[tokens][: row[count]].tolist(), row[drafted].tolist(), row[accepted].tolist())
        return result

    def prime(self, params, kv_caches, pending_tokens):
        """Run every built program once on an all-padding block (nothing live: no K/V written); returns kv_caches."""

        def run(T):
            nonlocal kv_caches
            inp = flat_input(self.parts["padding_input"](T))
            S = self.parts["buckets"].slots(T)
            history, budgets = np.zeros((S, self.history_len), np.int32), np.zeros(S, np.int32)
            program = self.programs.get(T)
            res, kv_caches = program(
                params, kv_caches, inp.ints, inp.floats, inp.verify, pending_tokens, history, budgets
            )
            jax.block_until_ready(res)

        self.programs.prime(run)
        return kv_caches
