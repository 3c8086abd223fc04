"""The CPU kernels' library built at install time (setup.py, kernels_pallas/cpu/library.py's `build_prebuilt`):
found under its key's name, the user's cache first, never under another key; built into a folder with older keys'
libraries removed; a failed build is one BuildError line. The C++ here is a one-line source, so nothing slow
compiles."""

import pytest

from kernels_pallas.cpu import library

needs_compiler = pytest.mark.skipif(
    library.unbuildable_reason() is not None, reason=f"no build here: {library.unbuildable_reason()}"
)


@pytest.fixture
def empty_places(monkeypatch, tmp_path):
    """An empty user cache and an empty install folder; (cache folder, install folder)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(library, "PREBUILT_DIR", tmp_path / "prebuilt")
    return tmp_path / "xdg" / "cbjax" / "kernels", tmp_path / "prebuilt"


@needs_compiler
def test_the_cache_first_then_the_install_never_another_key(empty_places):
    cache, prebuilt = empty_places
    with library.fresh_state():
        assert library.find_library() is None  # nothing built: a build is due
        name = f"cpu_kernels-{library.build_key()[0]}.so"
        prebuilt.mkdir()
        (prebuilt / "cpu_kernels-0123456789abcdef.so").write_bytes(b"")  # another key's: never taken
        assert library.find_library() is None
        (prebuilt / name).write_bytes(b"")
        assert library.find_library() == prebuilt / name
        cache.mkdir(parents=True)
        (cache / name).write_bytes(b"")
        assert library.find_library() == cache / name


@needs_compiler
def test_build_prebuilt_names_it_by_the_key_and_removes_older_keys(empty_places, monkeypatch, tmp_path):
    _, prebuilt = empty_places
    source = tmp_path / "tiny.cc"
    source.write_text('extern "C" int CbjaxTiny() { return 7; }\n')
    monkeypatch.setattr(library, "SOURCES", (source,))
    prebuilt.mkdir()
    stale = prebuilt / "cpu_kernels-0123456789abcdef.so"
    stale.write_bytes(b"")
    with library.fresh_state():
        path = library.build_prebuilt(prebuilt)
        assert path == prebuilt / f"cpu_kernels-{library.build_key()[0]}.so" and path.is_file()
        assert not stale.exists()
        assert library.find_library() == path  # what the run time loads (the cache is empty)
        assert sorted(p.name for p in prebuilt.iterdir()) == [path.name]  # no temporary files left


@needs_compiler
def test_a_failed_install_build_is_one_line_and_leaves_nothing(empty_places, monkeypatch, tmp_path):
    _, prebuilt = empty_places
    broken = tmp_path / "broken.cc"
    broken.write_text("int broken = ;\n")
    monkeypatch.setattr(library, "SOURCES", (broken,))
    with library.fresh_state():
        with pytest.raises(library.BuildError, match=r"compiling broken\.cc") as e:
            library.build_prebuilt(prebuilt)
        assert "\n" not in str(e.value)
    assert not list(prebuilt.glob("*.so"))


def test_an_unbuildable_machine_is_a_build_error(empty_places, monkeypatch):
    monkeypatch.setenv(library.BUILD_ENV_VAR, "fast")
    with library.fresh_state(), pytest.raises(library.BuildError, match="fast"):
        library.build_prebuilt(empty_places[1])
