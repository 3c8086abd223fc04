"""CompilationConfig: which attention kernels the step programs use, when they are built (the sampling extras'
too), and where compiled programs are kept between processes."""

import dataclasses

from cbjax.config import validation as check
from cbjax.config.section import Section
from kernels_pallas.choices import BACKENDS as ATTENTION_BACKENDS

# When the step programs (one per token bucket) are built: "background" (start serving at once; a background
# thread builds them, smallest first, and a step whose program is missing builds it itself), "full" (all before
# the engine's constructor returns: time nothing before that), "none" (each when first needed).
WARMUP_MODES = ("background", "full", "none")


@dataclasses.dataclass(frozen=True)
class CompilationConfig(Section):
    attention_backend: str = "auto"  # auto | pallas | xla (auto: pallas on TPU/GPU, xla on CPU)
    pallas_interpret: bool = False  # run Pallas kernels in interpret mode (CPU tests)
    warmup: bool | str = "background"  # one of WARMUP_MODES; True is "full", False "none"
    # Persistent compilation cache (cbjax/runner/compilation/jax_cache.py): "auto" (a folder in the user's cache
    # directory), "off", or a directory. The CBJAX_COMPILATION_CACHE environment variable overrides it.
    compilation_cache: str = "auto"
    # Build the sampling extras' programs at warmup (cbjax/runner/extras_runner.py: logprobs, prompt_logprobs,
    # penalties, min_tokens, bad words, logit bias, logits processors, structured output). False: each is built
    # when a request first needs it, which counts as a compile after warmup.
    sampling_extras: bool = False
    # The most logprobs / prompt_logprobs a request may ask for (vLLM's max_logprobs): a static shape of those
    # programs; a request asking for more is refused.
    max_logprobs: int = 20

    def checked(self) -> dict:
        return dict(
            attention_backend=check.choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
            pallas_interpret=check.boolean("pallas_interpret", self.pallas_interpret),
            warmup=check.choice("warmup", self.warmup, (True, False, *WARMUP_MODES)),
            compilation_cache=check.text("compilation_cache ('auto', 'off' or a directory)", self.compilation_cache),
            sampling_extras=check.boolean("sampling_extras", self.sampling_extras),
            max_logprobs=check.integer("max_logprobs", self.max_logprobs, 0, 1024),
        )

    @property
    def warmup_mode(self) -> str:
        """`warmup` as one of WARMUP_MODES."""
        return {True: "full", False: "none"}.get(self.warmup, self.warmup)
