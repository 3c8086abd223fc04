"""The house rules of docs/architecture.md (after ../shared/ARCHITECTURE.md), checked on the source: which room
imports which, no import cycle, no private name used across files, the engine without experiment or training
libraries, files of a readable size.

The import graph is read from the source (ast), so the checks see every module whether or not a test imports it.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("cbjax", "kernels_pallas")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    _module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if "assets" not in p.parts
}


def _imports(path: pathlib.Path, top_level_only: bool) -> list[tuple[str, list[str]]]:
    """(module, imported names) for each import of the file; `top_level_only` skips imports inside functions
    (those run when called, so they cannot make an import cycle)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import) and not (top_level_only and in_function):
                found.extend((a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and not (top_level_only and in_function):
                found.append((child.module, [a.name for a in child.names]))
            visit(child, inside)

    visit(tree, False)
    return found


def _project_targets(module: str, names: list[str]) -> set[str]:
    """The project modules an import statement loads: the module, its parent packages, and any submodule named in
    a `from package import submodule`."""
    if module.split(".")[0] not in PACKAGES:
        return set()
    parts = module.split(".")
    targets = {".".join(parts[: i + 1]) for i in range(len(parts))}
    targets |= {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
    return targets & set(MODULES)


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for module, names in _imports(path, top_level_only):
            edges |= _project_targets(module, names)
        graph[name] = edges - {name}
    return graph


def test_modules_were_found():
    assert {"cbjax.engine", "cbjax.core.scheduler", "cbjax.bench.workload", "kernels_pallas.dispatch"} <= set(MODULES)


def test_no_import_cycle():
    graph = _graph(top_level_only=True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            # A package's __init__ importing its own submodules is not a cycle of two files.
            if node.startswith(nxt + ".") and MODULES[nxt].name == "__init__.py":
                continue
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# The public API of namedtuples (StepInput._replace) is not private.
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}


def _private_names_defined(tree: ast.AST) -> set[str]:
    """The underscore names a file defines itself: its functions and classes, and attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_")}


def test_no_file_reaches_into_another_modules_private_names():
    """`obj._name` only on self or cls, or on a name the same file defines (its own class's instances, say):
    a helper that needs another class's private state uses a public method or lives in that class's room."""
    offenders = []
    for path in _all_project_files():
        tree = ast.parse(path.read_text(), str(path))
        own = _private_names_defined(tree) | NAMEDTUPLE_API
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) or node.attr in own:
                continue
            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders


def _all_project_files() -> list[pathlib.Path]:
    return [*MODULES.values(), *sorted((ROOT / "experiments").glob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]


def test_no_private_name_is_imported_across_files():
    offenders = [
        f"{path.relative_to(ROOT)}: from {module} import {n}"
        for path in _all_project_files()
        for module, names in _imports(path, top_level_only=False)
        if module.split(".")[0] in (*PACKAGES, "experiments", "tests")
        for n in names
        if n.startswith("_")
    ]
    assert not offenders


# Which project modules each room may import (anywhere in the file), after ARCHITECTURE.md's table of rooms.
ALLOWED = {
    # The options and their checks, at the bottom: every room of cbjax may import it; it imports only the kernels'
    # lists of allowed values (kernels_pallas/choices.py, jax-free).
    "cbjax.config": ("cbjax.config", "kernels_pallas"),
    "cbjax.core": ("cbjax.core", "cbjax.config"),
    "cbjax.bench": ("cbjax.bench", "cbjax.core", "cbjax.config"),
    "cbjax.model": ("cbjax.model", "cbjax.config", "kernels_pallas"),
    "cbjax.runner": ("cbjax.runner", "cbjax.core", "cbjax.config", "cbjax.model", "kernels_pallas"),
    "cbjax.sim": ("cbjax.sim", "cbjax.core", "cbjax.config"),
    "kernels_pallas": ("kernels_pallas",),
    # Structured output: a grammar engine (llguidance) behind core's TokenConstraint protocol; never jax.
    "cbjax.structured": ("cbjax.structured", "cbjax.core", "cbjax.config"),
    # The server sits on the engine; from the model room it uses what the engine hands out (its tokenizer, the
    # incremental detokenizer) and the registry that names checkpoints. Never the runner.
    "cbjax.serve": ("cbjax.serve", "cbjax.engine", "cbjax.core", "cbjax.config", "cbjax.model"),
}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_imports_only_what_it_may(room):
    bad = []
    for name, path in MODULES.items():
        if name != room and not name.startswith(room + "."):
            continue
        for module, names in _imports(path, top_level_only=False):
            for target in _project_targets(module, names):
                if target != "cbjax" and not any(target == a or target.startswith(a + ".") for a in ALLOWED[room]):
                    bad.append(f"{name} imports {target}")
    assert not bad


def _run_with_blocked(blocked: tuple[str, ...], imports: str) -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"{imports}\n"
        f"assert not [m for m in sys.modules if m.split('.')[0] in {blocked!r}]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_the_engine_needs_no_experiment_or_training_library():
    """The engine's dependencies are the runtime ones of pyproject.toml; the rest are extras ([bench], [train])."""
    # absl, optax and orbax are not in the list: flax itself imports them (they are flax's own dependencies).
    blocked = ("ml_collections", "matplotlib", "tqdm", "torch", "transformers", "hypothesis")
    _run_with_blocked(blocked, "from cbjax import LLM, LLMEngine, SamplingParams; import cbjax.generate")


def test_the_simulator_and_the_options_need_no_jax():
    _run_with_blocked(("jax", "jaxlib", "flax"), "import cbjax.sim, cbjax.engine_config, cbjax.config.compilation")


def test_the_experiment_room_needs_no_jax():
    _run_with_blocked(
        ("jax", "jaxlib", "flax"),
        "import cbjax.bench.workload, cbjax.bench.online, cbjax.bench.metrics, cbjax.bench.results, cbjax.bench.plots",
    )


def test_no_file_in_cbjax_is_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 450}
    long = {k: v for k, v in long.items() if k.startswith("cbjax")}
    assert not long, f"split these by concept: {long}"
