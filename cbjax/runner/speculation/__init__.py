"""Speculative decoding, the device side: the acceptance rules, verification inside the jitted step, the layout of
its verify rows, and the draft model (loaded and checked against the target, its own paged KV, its proposals made
on the device). The scheduling side is cbjax/core/speculation (no jax)."""
