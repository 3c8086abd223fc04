import os

# Tests run on the CPU whatever the machine has; set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
