"""ModelRunner: owns the parameters and the paged KV cache on device and runs one jitted step per call."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.model.llama import Llama, kv_cache_arrays
from cbjax.model.llama import kv_cache_dtype as kv_cache_dtype_of
from cbjax.runner import kv_swap, sharding
from cbjax.runner.compile_counter import CompileCounter
from cbjax.runner.draft_runner import DraftRunner
from cbjax.runner.flat_input import FlatStepInput, flat_input
from cbjax.runner.program_cache import ProgramCache
from cbjax.runner.static_arg import intern
from cbjax.runner.step_handle import StepHandle
from cbjax.runner.step_input import BucketTable, StepInput, empty_step_input
from cbjax.runner.step_packer import StepPacker
from cbjax.runner.step_program import step_program
from cbjax.runner.step_programs import StepPrograms
from cbjax.runner.verify import Speculation
from cbjax.runner.verify_rows import verified_tokens
from kernels_pallas.xla_attention import resolve_cpu_impls

WARMUP_MODES = ("full", "background", "none")


class ModelRunner:
    """Packs a SchedulerOutput into a StepInput, runs the compiled step, returns the sampled tokens on host.

    The KV cache is `num_pages + 1` pages per layer ([K, P+1, G, H] for K and V each): the extra page takes the
    writes of padding tokens, so they never touch a live page.

    With `num_host_pages > 0` the runner also owns a host-memory pool of that many KV pages, the target of the
    scheduler's swap-outs (preemption by swap); 0 disables swapping. Swaps move at most `swap_pages_per_call`
    pages per device call (see kv_swap.page_buckets).
    """

    def __init__(
        self,
        model: Llama,
        *,
        num_pages: int,
        page_size: int,
        buckets: BucketTable,
        backend: str = "xla",
        interpret: bool = False,
        num_host_pages: int = 0,
        swap_pages_per_call: int = kv_swap.MAX_PAGES_PER_CALL,
        program_cache_dir: str | None = None,
        device: "jax.Device | None" = None,
        mesh: "jax.sharding.Mesh | None" = None,
        kv_cache_dtype: str = "auto",
        acceptance=None,
        draft_model: Llama | None = None,
        num_scheduler_steps: int = 1,
    ):
        """`kv_cache_dtype`: the KV pages' dtype ("auto": the model's; "int8": kernels_pallas/kv_quant.py).
        `acceptance`: the rule verifying drafts (cbjax/runner/acceptance.py) when buckets.max_draft_tokens > 0.
        `draft_model`: drafts come from this model, proposed on the device in each verifying step
        (draft_runner.py, draft_proposals.py); None: from the scheduler's proposer (n-gram).
        `num_scheduler_steps` > 1: a third program family runs blocks of that many decode steps (decode_loop.py)."""
        cfg = model.cfg
        # The device this runner's parameters, KV pages and programs live on (None: jax's default). Replicas of a
        # data-parallel engine each get their own. Or a ("data", "model") mesh: tensor parallelism (sharding.py).
        if device is not None and mesh is not None:
            raise ValueError("a runner takes a device or a mesh, not both")
        self.device, self.mesh = device, mesh
        if mesh is not None:
            replicated = NamedSharding(mesh, PartitionSpec())
            put = lambda x: sharding.put_global(x, replicated)
        else:
            put = (lambda x: x) if device is None else (lambda x: jax.device_put(x, device))
        self.cfg = cfg
        self.model = model
        graphdef, state = nnx.split(model)
        # Flattened once: flattening an nnx.State sorts its keys, which cost ~1 ms per step on the host.
        leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
        if mesh is not None:
            self.params = sharding.place_params(leaves_with_paths, mesh)
        else:
            self.params = put([leaf for _, leaf in leaves_with_paths])
        self.graphdef = intern((graphdef, treedef))
        self.buckets = buckets
        K = buckets.max_draft_tokens
        if K:
            from cbjax.runner.acceptance import RejectionSampling, SampleAndMatch

            default = SampleAndMatch() if draft_model is None else RejectionSampling()
            self.speculation = Speculation(K, acceptance if acceptance is not None else default)
        else:
            self.speculation = None
        if draft_model is not None and (not K or mesh is not None):
            raise ValueError("a draft model needs speculation (max_draft_tokens > 0) and no tensor parallelism")
        self.page_size = page_size
        self.num_pages = num_pages
        self.pad_page = num_pages
        self.backend = backend
        self.interpret = interpret
        dt = kv_cache_dtype_of(cfg, kv_cache_dtype)
        # Per layer (k_pages, v_pages), and for int8 pages their scales [K, P+1, G, 1] too (kernels_pallas/kv_quant.py).
        arrays = kv_cache_arrays(cfg, num_pages + 1, page_size, kv_cache_dtype)
        if mesh is not None:
            kv_sharding = NamedSharding(mesh, sharding.kv_spec(cfg.num_kv_heads, mesh))
            zeros = lambda shape, dt: sharding.zeros_global(shape, dt, kv_sharding)
        else:
            zeros = lambda shape, dt: put(jnp.zeros(shape, dt))
        self.kv_caches = [tuple(zeros(*a) for a in arrays) for _ in range(cfg.num_layers)]
        # Several processes (multi-host, jax.distributed): the step's host inputs become global arrays too.
        self._global_inputs = mesh is not None and jax.process_count() > 1
        if num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {num_host_pages}")
        self.num_host_pages = num_host_pages
        self.host_pool = (
            None
            if num_host_pages == 0
            else kv_swap.HostKVPool(
                num_host_pages,
                num_device_pages=num_pages,
                num_layers=cfg.num_layers,
                num_kv_heads=cfg.num_kv_heads,
                page_size=page_size,
                head_dim=cfg.dim_per_head,
                dtype=dt,
                max_pages_per_call=swap_pages_per_call,
                quantized=dt == jnp.int8,
            )
        )
        self.compiles = CompileCounter()  # programs this runner's calls compiled (warmup included)
        # Abstract values of the step's array arguments: programs are lowered from these, never from the live
        # caches (the serving thread donates those while a background thread builds).
        placed = device is not None or mesh is not None  # else lowered for jax's default device, as before
        self._avals = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if placed else None),
            (self.params, self.kv_caches),
        )
        self.draft = None
        if draft_model is not None:
            cpu_impls = resolve_cpu_impls() if backend == "xla" else None
            self.draft = DraftRunner(
                draft_model,
                num_pages=num_pages,
                page_size=page_size,
                buckets=buckets,
                backend=backend,
                interpret=interpret,
                kv_cache_dtype=kv_cache_dtype,
                put=put,
                device=device,
                cpu_impls=cpu_impls,
                compiles=self.compiles,
            )
        self.programs = StepPrograms(buckets.token_buckets, self._build_program, self._program_key, self.compiles)
        # Speculation: a second program per bucket for the steps that verify drafts; a step without drafts (k = 0
        # from an adaptive rule, or no proposal) runs the plain program and costs what it costs without speculation.
        self.verify_programs = None
        family = lambda buckets, **kind: StepPrograms(
            buckets, *(functools.partial(f, **kind) for f in (self._build_program, self._program_key)), self.compiles
        )
        if self.speculation is not None:
            self.verify_programs = family(buckets.token_buckets, verify=True)
        # Blocks of decode steps (the scheduler plans none with speculation): a program per bucket of decodes only.
        self.block_programs, self.decode_steps = None, num_scheduler_steps
        if num_scheduler_steps > 1 and not K:
            top = buckets.token_bucket(min(buckets.max_num_seqs, buckets.token_buckets[-1]))
            self.block_programs = family([n for n in buckets.token_buckets if n <= top], steps=num_scheduler_steps)
        # Compiled step programs saved on disk for the next process (None: off).
        # (Not for a runner on another device than the default: a serialized program keeps its device assignment.)
        on_default = mesh is None and (device is None or device == jax.devices()[0])
        self.program_cache = None if program_cache_dir is None or not on_default else ProgramCache(program_cache_dir)
        self.swap_out_bytes_total = 0
        self.swap_in_bytes_total = 0
        # The last dispatched step's sampled tokens, on the device: the next step reads its pending tokens from
        # there (the packer knows each request's slot in that step).
        self._prev_tokens = self._no_pending = put(jnp.zeros(buckets.max_num_seqs, jnp.int32))
        self.packer = StepPacker(buckets, self.pad_page)
        self.last_step: StepHandle | None = None  # the last dispatched step

    @property
    def num_compiles(self) -> int:
        return self.compiles.num_compiles

    def _run(self, inp: "StepInput | FlatStepInput", verify: bool = False):
        """Run the step program of `inp`'s kind and bucket; its tokens stay on the device."""
        flat = flat_input(inp)
        programs = self.block_programs if flat.layout.blocks else self.programs
        program = (self.verify_programs if verify else programs).get(flat.layout.T)
        args = (flat.ints, flat.floats, flat.verify)
        if self._global_inputs:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            args = jax.tree.map(lambda a: sharding.put_global(a, replicated), args)
        if verify and self.draft is not None:
            d = self.draft
            tokens, self.kv_caches, d.kv_caches = program(
                self.params, self.kv_caches, *args, self._prev_tokens, d.params, d.kv_caches
            )
        else:
            tokens, self.kv_caches = program(self.params, self.kv_caches, *args, self._prev_tokens)
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
        placed = self.device is not None or self.mesh is not None
        prev = jax.ShapeDtypeStruct(
            (b.max_num_seqs,), jnp.int32, sharding=self._prev_tokens.sharding if placed else None
        )
        args, outs = (params, kv_caches, flat.ints, flat.floats, flat.verify, prev), (prev, kv_caches)
        if steps > 1:  # a block of decode steps: every step's tokens, and the last step's
            outs = ((jax.ShapeDtypeStruct((steps, b.max_num_seqs), jnp.int32), prev), kv_caches)
        drafting = verify and self.draft is not None
        if drafting:  # the draft's params and KV follow (see step_program.py)
            args, outs = args + self.draft.avals, outs + (self.draft.avals[1],)
        trees = jax.tree.structure((args, {})), jax.tree.structure(outs)
        # (The draft's part of the key holds its interned graphdef, whose repr is not stable across processes.)
        draft = (repr(self.draft.cfg), self.draft.key()[1]) if drafting else None
        description = ("step", repr(self.cfg), self._program_key(T, verify, steps)[1:-1], draft)
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
        if mode not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {mode!r}")
        t0 = time.perf_counter()
        if self.host_pool is not None:
            with self.compiles.counting():
                self.kv_caches = self.host_pool.warmup(self.kv_caches)
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
        and wait_for_programs, pay that here rather than in the first served steps (a timed run's, a simulator
        calibration's). Call it between steps, from the thread that dispatches them."""
        n = self.decode_steps
        kinds = ((self.programs, False, 1), (self.verify_programs, True, 1), (self.block_programs, False, n))
        for programs, verify, steps in kinds:
            if programs is not None:
                run = lambda T, v=verify, n=steps: jax.block_until_ready(self._run(self._padding_input(T, v, n), v))
                programs.prime(run)

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
        if out.seqs:
            handle.verified = verify = self.speculation is not None and out.num_draft_tokens > 0
            inp, handle.order = self.packer.pack(out, verify)
            handle.tokens = self._run(inp, verify)
            # A verifying step is received before the next is scheduled (the engine waits for it), so the next
            # step has no pending token to read from it. A block's next step reads its last step's tokens.
            if out.num_steps > 1:
                handle.tokens, self._prev_tokens = handle.tokens
            else:
                self._prev_tokens = self._no_pending if verify else handle.tokens
            handle.padded_tokens = inp.layout.T
        self.last_step = handle
        return handle

    def fetch(self, handle: StepHandle) -> np.ndarray:
        """Wait for a dispatched step; returns one sampled token per scheduled sequence, in out.seqs order (ignored
        where it does not sample); for a block of decode steps, a row of them per step."""
        if handle.tokens is None:
            return np.empty(0, np.int32)
        t0 = time.perf_counter()
        # The one device -> host copy of the step. (Across processes each reads its own copy; otherwise the array
        # itself, which costs the host ~0.1 ms less per step than building its shard's array first.)
        tokens = handle.tokens.addressable_data(0) if self._global_inputs else handle.tokens
        host_tokens = np.asarray(tokens)
        handle.wait_s = time.perf_counter() - t0
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
    def _program_families(self) -> list[StepPrograms]:
        families = [self.programs, self.verify_programs, self.block_programs]
        families += [self.draft.prefill_programs] if self.draft is not None else []
        return [f for f in families if f is not None]

    def wait_for_programs(self) -> None:
        """Until every step program (of every family) is built, then `prime` them."""
        for programs in self._program_families:
            programs.wait()
        self.prime()

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """dispatch + fetch: one step, synchronously."""
        return self.fetch(self.dispatch(out))
