"""The engine's options that the lower rooms read: the KV cache, model loading, parallelism and compilation
sub-configs, and the checks every public option goes through (validation.py). Kept free of jax and of the rest of
cbjax, so every room may import it. The scheduling, speculation and simulator sub-configs live beside the code that
reads them (cbjax/core/scheduler_config.py, cbjax/core/speculation/config.py, cbjax/sim/config.py), and
cbjax/engine_config.py composes all of them into one EngineConfig."""
