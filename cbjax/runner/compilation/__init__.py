"""Building the step programs and keeping them: one program per token bucket and kind (a program family, built
ahead, in the background or on demand), jax's persistent compilation cache, our own store of compiled programs on
disk, static arguments that hash once, and the compile counter that shows nothing compiles after warmup."""
