"""The device's n-gram lookup (cbjax/runner/speculation/ngram_device.py) proposes exactly what the host proposer
(cbjax/core/speculation/ngram.py) does, on random contexts with many repeats, for every k and lookup range."""

import numpy as np
import pytest

from cbjax.core.speculation.ngram import NgramProposer
from cbjax.runner.speculation.ngram_device import propose_ngram


@pytest.mark.parametrize("min_n, max_n", [(1, 1), (2, 4), (1, 3), (3, 3)])
def test_device_lookup_equals_the_host_proposer(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    S, L, K = 64, 48, 5
    host = NgramProposer(min_n, max_n)
    for vocab in (3, 6, 40):  # few symbols: long and many matches; many: few
        history = rng.integers(0, vocab, (S, L)).astype(np.int32)
        lengths = rng.integers(0, L + 1, S).astype(np.int32)
        lengths[:4] = [0, 1, min_n, min_n + 1]  # contexts too short to match, and just long enough
        ks = rng.integers(0, K + 1, S).astype(np.int32)
        drafts, counts = propose_ngram(history, lengths, ks, min_n, max_n, K)
        drafts, counts = np.asarray(drafts), np.asarray(counts)
        for s in range(S):
            want = host.propose(history[s, : lengths[s]], int(ks[s]))
            got = drafts[s, : counts[s]].tolist()
            assert got == want, (s, vocab, lengths[s], ks[s])
            assert (drafts[s, counts[s] :] == -1).all()


def test_device_lookup_ignores_what_follows_the_context():
    """The padding after a slot's context never matches or gets proposed."""
    history = np.array([[5, 6, 7, 5, 6, 9, 9, 9]], np.int32)
    drafts, counts = propose_ngram(history, np.array([5], np.int32), np.array([3], np.int32), 2, 2, 3)
    assert np.asarray(counts).tolist() == [3] and np.asarray(drafts).tolist() == [[7, 5, 6]]
    assert NgramProposer(2, 2).propose(history[0, :5], 3) == [7, 5, 6]


def test_bad_lookup_range_is_a_value_error():
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        propose_ngram(np.zeros((1, 4), np.int32), np.ones(1, np.int32), np.ones(1, np.int32), 3, 2, 2)
