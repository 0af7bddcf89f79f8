"""The package's shape: no import cycle, no package on both sides of the planning rule, and no
module reaching into another's private names (underscored, or left out of the ``__all__`` of a
module that names its API, as ``_layout``).

A call goes down, never back up (docs/native.md §0): the public ops check the arguments and
hand a per-device function to the global-array paths, which call down into it; the plan, the
implementations and the native path lie below them. The planning rule (``_plan``) splits the
layers: the impls it chooses among (``_native``, the custom calls) lie above it, what it
consults (``_executors``: capabilities, runtime, bootstrap; ``sim``) below, and no package has
modules on both sides. The checks read the sources with ``ast``, so they see the imports made
inside functions too (a lazy import is still an edge: it runs the first time that function
does). A package's ``__init__`` running before its modules is Python's rule, not an edge of
ours, so it is not one here.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxoverlap"
# Built, not written: the extensions and the build's record (CMakeLists.txt). Names, not sources.
BUILT = ("_host", "_cuda", "_cuda_fake", "_build_config")


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> source file, for every .py under ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(name: str, tree: ast.Module, is_package: bool) -> list[tuple[str, str, int]]:
    """(module, name or "", line) for every import in the module ``name``: ``import a.b``,
    ``from a import b`` (b a module or a name of a), ``__import__`` / ``import_module`` of a
    literal."""
    here = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(base, alias.name, node.lineno) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr == "import_module"))):
            found.append((node.args[0].value, "", node.lineno))
    return found


def import_graph(root: pathlib.Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, among the modules under ``root``."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for module, member, line in _imported(name, tree, path.name == "__init__.py"):
            if member in BUILT:
                continue  # an extension module: a leaf
            target = f"{module}.{member}" if f"{module}.{member}" in modules else module
            if target in modules and target != name:
                graph[name].setdefault(target, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle, as the modules along it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:  # the cycle, from its first module in name order
                ring = path[path.index(nxt):]
                first = ring.index(min(ring))
                return ring[first:] + ring[:first] + [min(ring)]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (not ``start`` itself)."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    seen.discard(start)
    return seen


def astride(graph: dict[str, dict[str, int]], pivot: str) -> dict[str, tuple[str, str]]:
    """The subpackages with a module below ``pivot`` (imported by it) and one above it
    (importing it), each with one of each: package -> (below, above)."""
    below = reachable(graph, pivot)
    above = {m for m in graph if m != pivot and pivot in reachable(graph, m)}
    top = pivot.split(".")[0]

    def package(m: str) -> str | None:
        parts = m.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 and parts[0] == top and (
            len(parts) > 2 or any(n.startswith(m + ".") for n in graph)) else None

    out: dict[str, tuple[str, str]] = {}
    for low in sorted(below):
        for high in sorted(above):
            p = package(low)
            if p is not None and p == package(high) and p not in out:
                out[p] = (low, high)
    return out


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:],
                                                                      strict=False)) \
        + f" -> {cycle[-1]}"


def _exported(path: pathlib.Path) -> set[str] | None:
    """The names of the module's ``__all__``, or None where it declares none."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "__all__"):
            return set(ast.literal_eval(node.value))
    return None


def private_uses(root: pathlib.Path) -> list[str]:
    """Every use, in one module, of a name another module of the package keeps to itself: an
    underscored one, or one missing from its ``__all__`` where it declares one (a named API,
    as ``_layout``'s) — through ``from jaxoverlap.m import name`` or ``m.name`` with ``m``
    bound to a package module. Underscored *modules* are the package's own layout and fine to
    import."""
    modules = _modules(root)
    pkg = root.name
    known = set(modules) | {f"{pkg}.{b}" for b in BUILT}
    exported = {m: _exported(path) for m, path in modules.items()}

    def hidden(module: str, member: str) -> bool:
        if f"{module}.{member}" in known or member.startswith("__"):
            return False
        names = exported.get(module)
        return member.startswith("_") or (names is not None and member not in names)

    bad = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for module, member, line in _imported(name, tree, path.name == "__init__.py"):
            if module.startswith(pkg) and member and module != name and hidden(module, member):
                bad.append(f"{name}:{line} imports {member} from {module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(pkg):
                        aliases[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(pkg):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id] != name
                    and hidden(aliases[node.value.id], node.attr)):
                bad.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return sorted(set(bad))


# ---------------------------------------------------------------- the package


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert "jaxoverlap.ops" in graph and len(graph) > 20, sorted(graph)  # it read the package
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {_describe(graph, cycle)}"


def test_no_package_sits_both_above_and_below_the_planning_rule():
    """``_native`` (the impl: primitive, attributes, site key) above ``_plan``; ``_executors``
    (what the rule consults: call, capabilities, bootstrap, runtime) below it."""
    graph = import_graph(PACKAGE)
    assert astride(graph, "jaxoverlap._plan") == {}
    below = reachable(graph, "jaxoverlap._plan")
    assert {"jaxoverlap._executors.capabilities", "jaxoverlap._executors.call",
            "jaxoverlap._executors.runtime"} <= below, sorted(below)
    assert not any(m.startswith("jaxoverlap._native") for m in below), sorted(below)
    assert "jaxoverlap._plan" in reachable(graph, "jaxoverlap._native.primitive")


def test_no_module_uses_another_modules_private_names():
    """Nor a name left out of a module's ``__all__`` (``_layout``'s: the Flax layers' API)."""
    assert private_uses(PACKAGE) == []


# ---------------------------------------------------------------- the checks fail when they must


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    pkg = root / "jaxoverlap"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "from jaxoverlap.ops import f\n",
        "ops.py": "from jaxoverlap import _spmd\n\ndef f():\n    return _spmd.g()\n",
        "_spmd.py": "def g():\n    from jaxoverlap import ops\n    return ops\n",
        "sim/__init__.py": "from jaxoverlap.sim.plan import Shape\n",
        "sim/plan.py": "from jaxoverlap.sim.confidence import check\nclass Shape: ...\n",
        "sim/confidence.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from jaxoverlap.sim.plan import Shape\ndef check(): ...\n"),
    })
    graph = import_graph(pkg)
    assert graph["jaxoverlap._spmd"] == {"jaxoverlap.ops": 2}
    assert find_cycle(graph) == ["jaxoverlap._spmd", "jaxoverlap.ops", "jaxoverlap._spmd"]
    del graph["jaxoverlap._spmd"]["jaxoverlap.ops"]
    assert find_cycle(graph) == ["jaxoverlap.sim.confidence", "jaxoverlap.sim.plan",
                                 "jaxoverlap.sim.confidence"]
    del graph["jaxoverlap.sim.confidence"]["jaxoverlap.sim.plan"]
    assert find_cycle(graph) is None  # a package's __init__ and its modules: no cycle


def test_a_cycle_through_the_top_package_and_dunder_import_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "from jaxoverlap._info import info\n",
        "_info.py": "def info():\n    return __import__('jaxoverlap').__version__\n",
    })
    assert find_cycle(import_graph(pkg)) == ["jaxoverlap", "jaxoverlap._info", "jaxoverlap"]


def test_a_package_astride_the_planning_rule_is_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "_plan.py": "from jaxoverlap._native import capabilities\n",
        "_local.py": "from jaxoverlap._native import primitive\n",
        "_native/__init__.py": "",
        "_native/capabilities.py": "",
        "_native/primitive.py": ("from jaxoverlap import _plan\n"
                                 "from jaxoverlap._native import capabilities\n"),
        "_executors/__init__.py": "",
        "_executors/runtime.py": "",
    })
    graph = import_graph(pkg)
    assert find_cycle(graph) is None
    assert astride(graph, "jaxoverlap._plan") == {
        "jaxoverlap._native": ("jaxoverlap._native.capabilities", "jaxoverlap._native.primitive")}
    (pkg / "_plan.py").write_text("from jaxoverlap._executors import runtime\n")
    assert astride(import_graph(pkg), "jaxoverlap._plan") == {}


def test_private_names_across_modules_are_found(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "_spmd.py": "AG = 'ag'\ndef _sharding_of(a): ...\n",
        "_layout.py": "__all__ = ['layouts']\ndef layouts(c): ...\ndef reopen(s): ...\n",
        "ops.py": "from jaxoverlap import _spmd\n\ndef f(a):\n    return _spmd._sharding_of(a)\n",
        "flax/_common.py": ("from jaxoverlap._spmd import AG, _sharding_of\n"
                            "from jaxoverlap import _host, _layout\nimport jaxoverlap.ops as ops\n"
                            "def g():\n    return ops._hidden, _host.x, ops.public\n"
                            "def h(c):\n    return _layout.layouts(c), _layout.reopen(c)\n"),
    })
    assert private_uses(pkg) == [
        "jaxoverlap.flax._common:1 imports _sharding_of from jaxoverlap._spmd",
        "jaxoverlap.flax._common:5 uses jaxoverlap.ops._hidden",
        "jaxoverlap.flax._common:7 uses jaxoverlap._layout.reopen",
        "jaxoverlap.ops:4 uses jaxoverlap._spmd._sharding_of",
    ]

