"""Speculative decoding, the scheduling side (no jax): the `speculative_config` option, the proposers (n-gram prompt
lookup; a draft model's proposals are made on the device, cbjax/runner/speculation), how many drafts a step
verifies, and how the scheduler gives a sequence its drafts and advances it by what the device accepted."""
