"""ModelRunner: owns the parameters and the paged KV cache on device and runs one jitted step per call.

Built by cbjax.runner.build.build_model_runner (or from the builders it calls, which tests use one by one); the
constructor only assembles the parts.
"""

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cbjax.core.runner_contract import check_warmup_mode
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.model.llama import Llama
from cbjax.runner import sharding
from cbjax.runner.compilation.counter import CompileCounter
from cbjax.runner.compilation.program_family import ProgramFamily
from cbjax.runner.compilation.program_store import ProgramStore
from cbjax.runner.extras_runner import SamplingExtras
from cbjax.runner.flat_input import FlatStepInput, flat_input
from cbjax.runner.kv_cache import num_device_pages
from cbjax.runner.kv_swap import HostKVPool
from cbjax.runner.page_copy import PageCopier
from cbjax.runner.placement import PlacedParams, Placement
from cbjax.runner.speculation.block_runner import SpeculativeBlocks
from cbjax.runner.speculation.constrained_verify import ConstrainedVerifier
from cbjax.runner.speculation.draft_runner import DraftRunner
from cbjax.runner.speculation.verification import Speculation
from cbjax.runner.speculation.verify_rows import verified_tokens
from cbjax.runner.step_handle import StepHandle
from cbjax.runner.step_input import BucketTable, StepInput, empty_step_input
from cbjax.runner.step_packer import StepPacker
from cbjax.runner.step_program import step_program
from cbjax.runner.token_stream import TokenStream
from kernels_pallas.xla_attention import resolve_cpu_impls


class ModelRunner:
    """Packs a SchedulerOutput into a StepInput, runs the compiled step, returns the sampled tokens on host.

    The KV cache is `num_pages + 1` pages per layer (kv_cache.py): the extra page takes the writes of padding
    tokens, so they never touch a live page. With a `host_pool` (kv_swap.py) the runner swaps KV pages to and from
    host memory (preemption by swap); without one, swapping is off. With `speculation`, a second program per token
    bucket verifies drafts (proposed on the device by `draft`, or by the scheduler's n-gram proposer without one).
    `num_scheduler_steps` > 1: a third program family runs blocks of that many decode steps (decode_loop.py); on
    the CPU their rows also reach the host step by step when `stream_rows` is set (token_stream.py, `fetch_row`).

    Two optional hooks, None by default (then each costs one attribute check per step):
    `timed(part)` returns a context manager wrapped around each part of the runner's host work in a step: "pack"
    (the step's input), "launch" (the program call) and "fetch" (waiting for the sampled tokens and reading them);
    cbjax/bench/host_timers.py times them. `on_dispatch(handle)` is called with every dispatched StepHandle
    (its `inp` holds the packed input): experiments/throughput.py records them to replay the steps.
    """

    advances_clock = False  # time passes on its own (the Runner contract, cbjax/core/runner_contract.py)

    def __init__(
        self,
        model: Llama,
        *,
        weights: PlacedParams,
        kv_caches: list,
        placement: Placement,
        buckets: BucketTable,
        backend: str,
        interpret: bool = False,
        compiles: CompileCounter | None = None,
        host_pool: HostKVPool | None = None,
        speculation: Speculation | None = None,
        draft: DraftRunner | None = None,
        program_store: ProgramStore | None = None,
        num_scheduler_steps: int = 1,
        extras: SamplingExtras | None = None,
    ):
        """`weights` and `kv_caches` placed by `placement` (place_params, allocate_kv_cache); `compiles` counts the
        programs this runner's calls compile (warmup included; a draft runner's too, so it is shared with `draft`);
        `program_store`: compiled step programs saved on disk for the next process (None: off); `extras`: the
        sampling extras (extras_runner.py) that sample the rows asking for logprobs, penalties or masks (None: a
        runner that serves plain sampling only)."""
        self.model, self.cfg = model, model.cfg
        self.placement, self.device, self.mesh = placement, placement.device, placement.mesh
        self.params, self.graphdef = weights
        self.kv_caches = kv_caches
        self.buckets, self.page_size = buckets, buckets.page_size
        self.num_pages = self.pad_page = num_device_pages(kv_caches)  # the spare page follows the live ones
        self.backend, self.interpret = backend, interpret
        self.compiles = CompileCounter() if compiles is None else compiles
        self.host_pool, self.speculation, self.draft = host_pool, speculation, draft
        self.program_cache = program_store
        self._global_inputs = placement.global_inputs
        self._avals = placement.abstract((self.params, self.kv_caches))  # what the programs are lowered from
        self.decode_steps = num_scheduler_steps
        self.token_stream = None  # each block step's tokens to the host as it ends (CPU, one device: token_stream.py)
        if num_scheduler_steps > 1 and self.mesh is None and (self.device is None or self.device.platform == "cpu"):
            self.token_stream = TokenStream.create(buckets.max_num_seqs, num_scheduler_steps)
        self._stream_target = None if self.token_stream is None else self.token_stream.target  # (block programs')
        self.stream_rows = False  # the engine's switch: whether the next blocks stream their rows
        self.programs, self.verify_programs, self.block_programs = self._families(num_scheduler_steps)
        self.swap_out_bytes_total = 0
        self.swap_in_bytes_total = 0
        # The last dispatched step's sampled tokens, on the device: the next step reads its pending tokens from
        # there (the packer knows each request's slot in that step).
        self.pending_tokens = self._no_pending = placement.put(jnp.zeros(buckets.max_num_seqs, jnp.int32))
        self.packer = StepPacker(buckets, self.pad_page)
        self.speculative_blocks = None  # n-gram speculation in blocks on the device (speculation/block_runner.py)
        if speculation is not None and speculation.device_lookup is not None and num_scheduler_steps > 1:
            parts = dict(buckets=buckets, graphdef=self.graphdef, backend=backend, interpret=interpret, mesh=self.mesh,
                global_inputs=self._global_inputs, avals=self._avals, no_pending=placement.abstract(self._no_pending),
                padding_input=functools.partial(self._padding_input, steps=num_scheduler_steps),
                key=functools.partial(self._program_key, steps=num_scheduler_steps))  # fmt: skip
            self.speculative_blocks = SpeculativeBlocks(
                lookup=speculation.device_lookup, iterations=num_scheduler_steps, max_drafts=speculation.max_drafts,
                rule=speculation.rule, runner_parts=parts, compiles=self.compiles)  # fmt: skip
        self.page_copier = PageCopier(buckets.max_num_seqs, self.pad_page)  # copy-on-write of shared pages
        self.last_step: StepHandle | None = None  # the last dispatched step
        self.timed: Callable[[str], AbstractContextManager] | None = None
        self.on_dispatch: Callable[[StepHandle], None] | None = None
        self.extras = extras
        # A verifying step that holds a structured-output request runs the masked variant (constrained_verify.py).
        self.constrained_verify = None
        if speculation is not None and extras is not None:
            self.constrained_verify = ConstrainedVerifier(
                graphdef=self.graphdef,
                speculation=speculation,
                backend=backend,
                interpret=interpret,
                mesh=self.mesh,
                vocab_size=self.cfg.vocab_size,
                compiles=self.compiles,
            )
        self.sample_hidden = None  # the last plain step's sample rows' hidden states [S, D], on the device

    def _families(self, num_scheduler_steps: int) -> tuple[ProgramFamily, ProgramFamily | None, ProgramFamily | None]:
        """The step programs (one per token bucket), the verifying ones (with speculation: a step without drafts
        runs the plain program and costs what it costs without speculation), and the blocks of decode steps (a
        program per bucket of decodes only; with speculation, for the steps whose draft-length rule chose k = 0)."""
        b = self.buckets
        family = lambda buckets, **kind: ProgramFamily(
            buckets, *(functools.partial(f, **kind) for f in (self._build_program, self._program_key)), self.compiles
        )
        plain = ProgramFamily(b.token_buckets, self._build_program, self._program_key, self.compiles)
        verify = blocks = None
        if self.speculation is not None:
            verify = family(b.token_buckets, verify=True)
        if num_scheduler_steps > 1:
            top = b.token_bucket(min(b.max_num_seqs, b.token_buckets[-1]))
            blocks = family([n for n in b.token_buckets if n <= top], steps=num_scheduler_steps)
        return plain, verify, blocks

    @property
    def num_compiles(self) -> int:
        return self.compiles.num_compiles

    def run_input(self, inp: "StepInput | FlatStepInput", verify: bool = False, stream_meta=None):
        """Run a packed step input on the program of its kind and bucket (built now if it is not yet), on this
        runner's parameters and KV cache (the step's KV writes land there) and the last dispatched step's pending
        tokens; returns the sampled tokens, still on the device (for a block of decode steps: every step's and the
        last step's). `dispatch` packs and runs a step through this; benchmarks replay recorded inputs with it
        (experiments/throughput.py) or time one program (experiments/profile_step.py). `stream_meta`: a block's
        token stream (TokenStream.reserve; None: its rows are not streamed)."""
        flat = flat_input(inp)
        programs = self.block_programs if flat.layout.blocks else self.programs
        program = (self.verify_programs if verify else programs).get(flat.layout.T)
        args = (flat.ints, flat.floats, flat.verify)
        if flat.layout.blocks:  # (after the pending tokens and the draft model's two empty places)
            tail = (None, None, TokenStream.off_meta() if stream_meta is None else stream_meta)
        if self._global_inputs:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            args = jax.tree.map(lambda a: sharding.put_global(a, replicated), args)
        if verify and self.draft is not None:
            d = self.draft
            tokens, self.kv_caches, d.kv_caches = program(
                self.params, self.kv_caches, *args, self.pending_tokens, d.params, d.kv_caches
            )
        elif flat.layout.blocks:
            tokens, self.kv_caches = program(self.params, self.kv_caches, *args, self.pending_tokens, *tail)
        elif verify:
            tokens, self.kv_caches = program(self.params, self.kv_caches, *args, self.pending_tokens)
        else:  # a plain step: its sample rows' hidden states stay on the device for the sampling extras
            tokens, self.sample_hidden, self.kv_caches = program(
                self.params, self.kv_caches, *args, self.pending_tokens
            )
        return tokens

    def _program_key(self, T: int, verify: bool = False, steps: int = 1) -> tuple:
        b = self.buckets
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(self._avals))
        # The xla backend's decode and prefill rows run the C++ kernel or the XLA loop (chosen at trace time, see
        # xla_attention).
        cpu_impls = resolve_cpu_impls() if self.backend == "xla" else None
        return (
            self.graphdef,
            self.backend,
            cpu_impls,
            self.interpret,
            None if self.device is None else self.device.id,
            self.mesh,
            shapes,
            T,
            b.slots(T),
            b.pages_per_seq,
            b.max_num_seqs,
            steps,
            self._stream_target if steps > 1 else None,
            self.speculation if verify else None,
            self.draft.key() if verify and self.draft is not None else None,
        )

    def _padding_input(self, T: int, verify: bool = False, steps: int = 1) -> StepInput:
        b = self.buckets
        rows = b.verify_rows(T) if verify else 0
        inp = empty_step_input(T, b.slots(T), b.pages_per_seq, self.pad_page, self.page_size, rows)
        # (A block's padding runs one step, so `prime` runs its loop's body: the padding rows write the spare page.)
        return inp if steps == 1 else inp._replace(decode_steps=np.ones(b.slots(T), np.int32))

    def _build_program(self, T: int, verify: bool = False, steps: int = 1):
        """The step for token bucket T: loaded from the program cache, else traced, lowered and compiled."""
        b = self.buckets
        flat = flat_input(self._padding_input(T, verify, steps))
        params, kv_caches = self._avals
        prev = self.placement.abstract(self._no_pending)
        args, outs = (params, kv_caches, flat.ints, flat.floats, flat.verify, prev), (prev, kv_caches)
        if steps == 1 and not verify:  # a plain step also returns its sample rows' hidden states (the tree's shape)
            outs = (prev, prev, kv_caches)
        if steps > 1:  # a block of decode steps: every step's tokens, and the last step's; it takes a stream's meta
            outs = ((jax.ShapeDtypeStruct((steps, b.max_num_seqs), jnp.int32), prev), kv_caches)
            args += (None, None, TokenStream.off_meta())
        drafting = verify and self.draft is not None
        if drafting:  # the draft's params and KV follow (see step_program.py)
            args, outs = args + self.draft.avals, outs + (self.draft.avals[1],)
        trees = jax.tree.structure((args, {})), jax.tree.structure(outs)
        # (The draft's part of the key holds its interned graphdef, whose repr is not stable across processes.)
        draft = (repr(self.draft.cfg), self.draft.key()[1]) if drafting else None
        description = ("step+sample_hidden", repr(self.cfg), self._program_key(T, verify, steps)[1:-1], draft)
        if self.program_cache is not None:
            program = self.program_cache.load(description, *trees, device=self.device)
            if program is not None:
                self.compiles.count_loaded()
                return program
        lowered = step_program.lower(
            *args,
            layout=flat.layout,
            graphdef=self.graphdef,
            backend=self.backend,
            interpret=self.interpret,
            mesh=self.mesh,
            speculation=self.speculation if verify else None,
            draft_graphdef=self.draft.graphdef if drafting else None,
            decode_steps=steps,
            stream_target=self._stream_target if steps > 1 else None,
        )
        fresh = CompileCounter()
        with fresh.counting():
            program = lowered.compile()
        # Only a program XLA just compiled is saved: one that jax's persistent cache served serializes without its
        # kernels (it then fails at run time with "Function ... not found"; seen with jax 0.10.2 on CPU).
        if self.program_cache is not None and fresh.num_cache_hits == 0:
            self.program_cache.save(description, program, *trees)
        return program

    def warmup(self, mode: str = "full") -> float:
        """Build the step programs: "full" every token bucket's now, and `prime` them; "background" in a background
        thread (a step whose bucket is not built yet builds it at once); "none" each when a step first needs it.
        The swap programs (when swapping is on) are built now in any mode. Returns the seconds this call took."""
        check_warmup_mode(mode)
        t0 = time.perf_counter()
        # The copy-on-write program, built in any mode (not counted: num_compiles counts the step and swap programs;
        # a compile of it at a step would be, dispatch copies inside `counting`).
        self.kv_caches = self.page_copier.warmup(self.kv_caches)
        if self.host_pool is not None:
            with self.compiles.counting():
                self.kv_caches = self.host_pool.warmup(self.kv_caches)
        if self.extras is not None and mode != "none":
            self.extras.warmup(self.params)
            if self.constrained_verify is not None and self.extras.precompile:
                inputs = [self._padding_input(T, True) for T in self.buckets.token_buckets]
                self.kv_caches = self.constrained_verify.warmup(
                    self.params, self.kv_caches, self.draft, inputs, self._no_pending
                )
        if mode == "full":
            for programs in self._program_families:
                programs.build_all()
            self.prime()
        elif mode == "background":
            for programs in self._program_families:
                programs.start_background()
        return time.perf_counter() - t0

    def prime(self) -> None:
        """Run every built step program (plain and verifying) that has not run on this runner yet once, on an
        all-padding input: its KV writes go to the spare page and its tokens are dropped. The first run of a
        program in a process, and a fresh runner's first step, take 2-4x a later run of the same shape (a fresh
        engine's first step in experiments/sim_fidelity.py: 88 ms against 20, docs/sim.md): a full warmup,
        and wait_until_warm, pay that here rather than in the first served steps (a timed run's, a simulator
        calibration's). Call it between steps, from the thread that dispatches them."""
        n = self.decode_steps
        kinds = ((self.programs, False, 1), (self.verify_programs, True, 1), (self.block_programs, False, n))
        for programs, verify, steps in kinds:
            if programs is not None:
                run = lambda T, v=verify, n=steps: jax.block_until_ready(
                    self.run_input(self._padding_input(T, v, n), v)
                )
                programs.prime(run)
        if self.speculative_blocks is not None:
            self.kv_caches = self.speculative_blocks.prime(self.params, self.kv_caches, self._no_pending)

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> tuple[float, int, int]:
        """Copy KV pages between device and host: every (device page, host page) of `swap_out` first, then every
        (host page, device page) of `swap_in`, so a swap-in may reuse a device page freed by a swap-out. Returns
        once the copies are done, with (seconds, bytes out, bytes in). Raises ValueError (before copying anything)
        without a host pool, for page indices out of range, or for a destination page written twice."""
        if self.host_pool is None:
            raise ValueError("KV swap needs a host pool, but this runner has num_host_pages=0 (swap disabled)")
        pool = self.host_pool
        out_dev, out_host, in_host, in_dev = pool.check(swap_out, swap_in)
        t0 = time.perf_counter()
        with self.compiles.counting():
            if len(out_dev):
                pool.swap_out(self.kv_caches, out_dev, out_host)  # waits for the host copy
            if len(in_host):
                self.kv_caches = pool.swap_in(self.kv_caches, in_host, in_dev)
                jax.block_until_ready(self.kv_caches)  # so the time holds the whole copy, not just its dispatch
        out_bytes, in_bytes = len(out_dev) * pool.bytes_per_page, len(in_host) * pool.bytes_per_page
        self.swap_out_bytes_total += out_bytes
        self.swap_in_bytes_total += in_bytes
        return time.perf_counter() - t0, out_bytes, in_bytes

    def dispatch(self, out: SchedulerOutput) -> StepHandle:
        """Start one step: its KV swaps first (if any; they complete here), then the forward pass (if any sequence
        is scheduled), which runs asynchronously. A pending token of a request (sampled by the previously
        dispatched step) is fed in on the device."""
        handle = StepHandle(out, None, [])
        if self.draft is not None:  # (its catch-up prefills run before the step's program, on the device's queue)
            self.draft.before_step(out, self.speculation is not None and out.num_draft_tokens > 0)
        if out.swap_out or out.swap_in:
            handle.swap_s, handle.swap_out_bytes, handle.swap_in_bytes = self.swap(out.swap_out, out.swap_in)
        if out.page_copies:  # copy-on-write (core/sequence_group.py), queued on the device before the step
            with self.compiles.counting():
                self.kv_caches = self.page_copier(self.kv_caches, out.page_copies)
        if out.seqs:
            handle.verified = verify = self.speculation is not None and out.num_draft_tokens > 0
            meta = None
            if out.num_steps > 1 and self.stream_rows and self.token_stream is not None and not self._speculative(out):
                handle.stream_base, meta = self.token_stream.reserve(out.num_steps)
            timed = self.timed
            if timed is None:
                inp, handle.order = self.packer.pack(out, verify)
                handle.tokens = self._launch(out, inp, handle.order, verify, meta)
            else:
                with timed("pack"):
                    inp, handle.order = self.packer.pack(out, verify)
                with timed("launch"):
                    handle.tokens = self._launch(out, inp, handle.order, verify, meta)
            if self.extras is not None and out.num_steps == 1 and not verify:
                handle.tokens, handle.extras = self.extras.after_step(
                    self.params, out, handle.order, inp, self.sample_hidden, handle.tokens
                )
            # A verifying step is received before the next is scheduled (the engine waits for it), so the next
            # step has no pending token to read from it. A block's next step reads its last step's tokens.
            if self._speculative(out):
                self.pending_tokens = self._no_pending  # (the engine receives it before scheduling the next)
            elif out.num_steps > 1:
                handle.tokens, self.pending_tokens = handle.tokens
            else:
                self.pending_tokens = self._no_pending if verify else handle.tokens
            handle.inp, handle.padded_tokens = inp, inp.layout.T
        self.last_step = handle
        if self.on_dispatch is not None:
            self.on_dispatch(handle)
        return handle

    def _speculative(self, out: SchedulerOutput) -> bool:
        """Whether `out` is a block of n-gram speculation (speculation/block_runner.py; its rows do not stream)."""
        return self.speculative_blocks is not None and self.speculative_blocks.runs(out)

    def _launch(self, out: SchedulerOutput, inp: StepInput, order: list[int], verify: bool, stream_meta=None):
        """Run a packed step; a verifying step holding a structured-output request on the masked variant."""
        if self._speculative(out):
            blocks = self.speculative_blocks
            tokens, self.kv_caches = blocks.run(self.params, self.kv_caches, inp, order, out, self.pending_tokens)
            return tokens
        cv = self.constrained_verify
        if verify and cv is not None and cv.needed(out.seqs):
            tokens, self.kv_caches = cv.run(
                self.params, self.kv_caches, self.draft, inp, self.pending_tokens, out.seqs, order
            )
            return tokens
        return self.run_input(inp, verify, stream_meta)

    def fetch_row(self, handle: StepHandle) -> list[int] | None:
        """The tokens of the next step of a dispatched block whose rows stream (`handle.stream_base`), in out.seqs
        order (ints), once the device has run that step (the wait counts in `handle.row_wait_s`); None if the block does
        not stream (anymore: a row that did not arrive ends its streaming, and `fetch` reads the rest)."""
        return None if handle.stream_base is None else self.token_stream.next_row(handle)

    def fetch(self, handle: StepHandle) -> np.ndarray:
        """Wait for a dispatched step; returns one sampled token per scheduled sequence, in out.seqs order (ignored
        where it does not sample); for a block of decode steps, a row of them per step."""
        timed = self.timed
        if timed is None:
            return self._fetch(handle)
        with timed("fetch"):
            return self._fetch(handle)

    def _fetch(self, handle: StepHandle) -> np.ndarray:
        if handle.tokens is None:
            return np.empty(0, np.int32)
        t0 = time.perf_counter()
        # The one device -> host copy of the step. (Across processes each reads its own copy; otherwise the array
        # itself, which costs the host ~0.1 ms less per step than building its shard's array first.)
        tokens = handle.tokens.addressable_data(0) if self._global_inputs else handle.tokens
        host_tokens = np.asarray(tokens)
        handle.wait_s = time.perf_counter() - t0
        if handle.extras is not None:
            self.extras.receive(handle.extras, host_tokens)
        if self._speculative(handle.out):
            return self.speculative_blocks.results(handle.out, handle.order, host_tokens)
        if handle.verified:
            return verified_tokens(handle.out.seqs, handle.order, host_tokens)
        n = len(handle.order)
        if host_tokens.ndim == 2:  # a block of decode steps: a row per step
            result = np.empty((handle.out.num_steps, n), np.int32)
            result[:, handle.order] = host_tokens[: handle.out.num_steps, :n]
            return result
        result = np.empty(n, np.int32)
        result[handle.order] = host_tokens[:n]
        return result

    @property
    def _program_families(self) -> list[ProgramFamily]:
        families = [self.programs, self.verify_programs, self.block_programs]
        families += [self.draft.prefill_programs] if self.draft is not None else []
        families += [self.speculative_blocks.programs] if self.speculative_blocks is not None else []
        return [f for f in families if f is not None]

    def wait_until_warm(self) -> None:
        """Return once every step program (of every family) is built and has run once (`prime`): a timed run that
        starts now compiles nothing and pays no first run. Call it between steps."""
        for programs in self._program_families:
            programs.wait()
        self.prime()

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """dispatch + fetch: one step, synchronously."""
        return self.fetch(self.dispatch(out))
