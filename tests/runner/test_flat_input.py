"""FlatStepInput (cbjax/runner/flat_input.py): a step's input flattened into one int32 and one float32 buffer comes
back field for field, on the host and inside a traced program (seeds keep all 32 bits)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.runner.flat_input import FLOAT_FIELDS, INT_FIELDS, flat_input, layout_of
from cbjax.runner.step_input import StepInput, empty_step_input


def random_input(T: int, S: int, W: int, blocks: bool, seed: int) -> StepInput:
    rng = np.random.default_rng(seed)
    base = empty_step_input(T, S, W, pad_page=7, page_size=4)
    fields = {}
    for name in INT_FIELDS[:-1] + FLOAT_FIELDS:
        a = getattr(base, name)
        if a.dtype == np.uint32:
            fields[name] = rng.integers(0, 2**32, a.shape, dtype=np.uint64).astype(np.uint32)
        elif a.dtype == np.float32:
            fields[name] = rng.random(a.shape, dtype=np.float32)
        else:
            fields[name] = rng.integers(-(2**31), 2**31, a.shape, dtype=np.int64).astype(np.int32)
    if blocks:
        fields["decode_steps"] = rng.integers(0, 9, S).astype(np.int32)
    return base._replace(**fields)


def assert_equal_inputs(a: StepInput, b: StepInput) -> None:
    for name in StepInput._fields:
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            assert x is None and y is None, name
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("T,S,W,blocks", [(16, 16, 3, False), (48, 32, 5, True), (2048, 256, 32, False)])
def test_flatten_and_back_on_the_host(T, S, W, blocks):
    inp = random_input(T, S, W, blocks, seed=T + S)
    flat = flat_input(inp)
    assert flat.ints.dtype == np.int32 and flat.floats.dtype == np.float32
    assert flat.ints.shape == (flat.layout.num_ints,) and flat.floats.shape == (2 * S,)
    assert flat.layout == layout_of(inp) and flat.layout.blocks == blocks and flat.num_tokens == T
    assert_equal_inputs(flat.unflatten(), inp)
    assert flat_input(flat) is flat


def test_flatten_and_back_in_a_traced_program():
    inp = random_input(32, 16, 4, True, seed=3)
    flat = flat_input(inp)
    to_u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
    back = jax.jit(lambda i, f: flat.layout.unflatten(i, f, to_uint32=to_u32))(flat.ints, flat.floats)
    assert_equal_inputs(jax.tree.map(np.asarray, back), inp)


def test_layouts_of_different_shapes_differ():
    a, b = (layout_of(empty_step_input(T, S, 4, 7, 4)) for T, S in ((16, 16), (24, 16)))
    assert a != b
    assert layout_of(empty_step_input(16, 16, 4, 7, 4)) == a
