"""ModelRunner: owns the parameters and the paged KV cache on device and runs one jitted step per call."""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.core.scheduler import SchedulerOutput
from cbjax.model.llama import AttentionMetadata, Llama
from cbjax.runner.sampler import sample
from cbjax.runner.step_input import BucketTable, StepInput, empty_step_input, pack_step

# Incremented while tracing, i.e. once per compiled program: the runner's compile counter reads it.
_TRACES = [0]


class _Static:
    """A static jit argument with a precomputed hash and identity equality.

    jit hashes its static arguments on every call; hashing an NNX GraphDef walks the whole module tree (~3 ms a
    step measured on llama-tiny). Interned instances (one per distinct graphdef, see `_intern`) hash once, and
    runners of identical models still share compiled programs.
    """

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other


_INTERNED: dict = {}


def _intern(value) -> _Static:
    return _INTERNED.setdefault(value, _Static(value))


@functools.partial(jax.jit, static_argnames=("graphdef", "backend", "interpret"), donate_argnames=("kv_caches",))
def _step(params, kv_caches, inp: StepInput, *, graphdef, backend: str, interpret: bool):
    """params: the model state's leaves; graphdef: interned (GraphDef, state treedef)."""
    _TRACES[0] += 1
    module_def, treedef = graphdef.value
    model = nnx.merge(module_def, jax.tree.unflatten(treedef, params))
    md = AttentionMetadata(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
    hidden, kv_caches = model(inp.token_ids, inp.positions, kv_caches, md, backend, interpret)
    logits = model.logits(hidden[inp.sample_idx])  # only each sequence's last token: [B, V], not [T, V]
    tokens = sample(logits, inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters)
    return tokens, kv_caches


class ModelRunner:
    """Packs a SchedulerOutput into a StepInput, runs the compiled step, returns the sampled tokens on host.

    The KV cache is `num_pages + 1` pages per layer ([K, P+1, G, H] for K and V each): the extra page takes the
    writes of padding tokens, so they never touch a live page.
    """

    def __init__(self, model: Llama, *, num_pages: int, page_size: int, buckets: BucketTable,
                 backend: str = "reference", interpret: bool = False):
        cfg = model.cfg
        self.cfg = cfg
        self.model = model
        graphdef, state = nnx.split(model)
        # Flattened once: flattening an nnx.State sorts its keys, which cost ~1 ms per step on the host.
        self.params, treedef = jax.tree.flatten(state)
        self.graphdef = _intern((graphdef, treedef))
        self.buckets = buckets
        self.page_size = page_size
        self.num_pages = num_pages
        self.pad_page = num_pages
        self.backend = backend
        self.interpret = interpret
        shape = (cfg.num_kv_heads, num_pages + 1, page_size, cfg.dim_per_head)
        dt = jnp.dtype(cfg.dtype)
        self.kv_caches = [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.num_layers)]
        self.num_compiles = 0
        self.last_host_s = 0.0
        self.last_device_s = 0.0

    def _run(self, inp: StepInput):
        before = _TRACES[0]
        tokens, self.kv_caches = _step(self.params, self.kv_caches, inp, graphdef=self.graphdef,
                                       backend=self.backend, interpret=self.interpret)
        self.num_compiles += _TRACES[0] - before
        return tokens

    def warmup(self) -> float:
        """Compile every (token bucket, page bucket) shape; returns seconds spent."""
        t0 = time.perf_counter()
        b = self.buckets
        for T in b.token_buckets:
            self._run(empty_step_input(T, b.slots(T), b.pages_per_seq, self.pad_page, self.page_size)
                      ).block_until_ready()
        return time.perf_counter() - t0

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Run one step; returns one sampled token per scheduled sequence (ignored where it does not sample)."""
        t0 = time.perf_counter()
        inp, order = pack_step(out, self.buckets, self.pad_page)
        tokens = self._run(inp)
        t1 = time.perf_counter()
        host_tokens = np.asarray(tokens)  # the one device -> host copy of the step
        t2 = time.perf_counter()
        self.last_host_s, self.last_device_s = t1 - t0, t2 - t1
        self.last_padded_tokens = inp.token_ids.shape[0]
        result = np.empty(len(order), np.int32)
        result[order] = host_tokens[:len(order)]
        return result
