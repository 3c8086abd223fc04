import pytest

from cbjax.core import PagePool


def test_allocate_free_roundtrip():
    pool = PagePool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free == 0
    assert not pool.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 3
    pool.check_consistent()


def test_refcounts_share_and_never_go_negative():
    pool = PagePool(4)
    (p,) = pool.allocate(1)
    pool.incref([p])
    assert pool.refcount(p) == 2
    pool.free([p])
    assert pool.refcount(p) == 1 and pool.num_free == 3
    pool.free([p])
    assert pool.refcount(p) == 0 and pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([p])
    with pytest.raises(RuntimeError, match="incref of free page"):
        pool.incref([p])
    pool.check_consistent()
