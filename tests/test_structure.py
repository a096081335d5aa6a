"""The structure docs/ARCHITECTURE.md describes, checked against the code: import directions (between the
packages and between streamer's layers), no import cycles, no reaching into another module's private names,
modules under the size limit, memory_model without torch, the module table naming exactly the modules that exist,
few `type: ignore` (each with a reason) and the runtime's collaborators wired through one object."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("layers", "memory_model", "streamer", "benchmarks")
# Who may import whom: layers <- memory_model <- streamer; benchmarks use them all; nothing imports benchmarks.
MAY_IMPORT = {
    "layers": {"layers"},
    "memory_model": {"layers", "memory_model"},
    "streamer": {"layers", "memory_model", "streamer"},
    "benchmarks": {"layers", "memory_model", "streamer", "benchmarks"},
}
# Inside streamer, what a layer may not import, at any depth (an import inside a function counts): the store
# and the runtime run a step, the trainer drives them, calibration measures the trainer, the CLI uses them all.
TRAINER = ("streamer.trainer", "streamer.step_policy", "streamer.persistence")  # the trainer and its two concerns
ABOVE = {
    "streamer.store": ("streamer.runtime", *TRAINER, "streamer.calibration", "streamer.session", "streamer.cli"),
    "streamer.runtime": (*TRAINER, "streamer.calibration", "streamer.session", "streamer.cli"),
    **{module: ("streamer.calibration", "streamer.session", "streamer.cli") for module in TRAINER},
    "streamer.calibration": ("streamer.session", "streamer.cli"),
    "streamer.session": ("streamer.cli",),
}
# A module past this many lines says why at the top of its docstring ("Long because ..."): it is a prompt to
# look for a second concern, not a budget to squeeze code under.
LONG_MODULE = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names taken from it) for every import in the file, at any depth (function-level too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _ours(module: str) -> str | None:
    """The module of this project an import resolves to (the longest known prefix), else None."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names in _imports(path):
            target = _ours(module)
            if target is None:
                continue
            # `from package import submodule` imports the submodule, not only the package's face.
            subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES}
            graph[name] |= subs or {target}
    for name in graph:
        graph[name].discard(name)
    return graph


def test_packages_import_only_downwards_and_nothing_imports_benchmarks() -> None:
    wrong = [f"{name} imports {target}" for name, targets in _edges().items() for target in targets
             if target.split(".")[0] not in MAY_IMPORT[name.split(".")[0]]]
    assert not wrong, "imports against the direction layers <- memory_model <- streamer <- benchmarks:\n" + \
        "\n".join(wrong)


def test_streamer_layers_import_only_downwards() -> None:
    def above(name: str, target: str) -> bool:
        return any((name == low or name.startswith(low + ".")) and (target == high or target.startswith(high + "."))
                   for low, highs in ABOVE.items() for high in highs)
    wrong = [f"{name} imports {target}" for name, targets in _edges().items() for target in targets
             if above(name, target)]
    assert not wrong, "imports that run back up (store <- runtime <- trainer <- calibration <- cli):\n" + \
        "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = _edges()
    # A package's __init__ re-exports its modules; importing the package face from inside is not a cycle of
    # design, so faces are left out of the cycle search.
    faces = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    cycles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node] - faces):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(set(graph) - faces):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _private_names(tree: ast.AST) -> set[str]:
    """The _names a module defines: functions, classes, module and class attributes, self._x assignments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_takes_another_modules_private_names() -> None:
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    defined = {name: _private_names(tree) for name, tree in trees.items()}
    wrong = []
    for name, tree in trees.items():
        for module, names in _imports(MODULES[name]):
            if _ours(module) is not None and _ours(module) != name:
                wrong += [f"{name} imports {module}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
        others = set().union(*(d for other, d in defined.items() if other != name)) - defined[name]
        for node in ast.walk(tree):  # obj._name, where only another module of ours defines _name
            if isinstance(node, ast.Attribute) and node.attr in others:
                wrong.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def test_long_modules_say_why() -> None:
    silent = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > LONG_MODULE
              and "Long because" not in (ast.get_docstring(ast.parse(path.read_text())) or "")}
    assert not silent, f"modules over {LONG_MODULE} lines without 'Long because ...' in their docstring: {silent}"


def test_memory_model_imports_without_torch() -> None:
    modules = sorted(name for name in MODULES if name.split(".")[0] == "memory_model")
    code = "import sys; sys.modules['torch'] = None\n" + "".join(f"import {m}\n" for m in modules)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_architecture_module_table_names_every_module() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", text, flags=re.M))
    actual = {str(path.relative_to(ROOT)) for path in MODULES.values() if path.name not in ("__init__.py",
                                                                                              "__main__.py")}
    assert listed == actual, (f"docs/ARCHITECTURE.md's module table lacks {sorted(actual - listed)} and names "
                              f"missing modules {sorted(listed - actual)}")


def test_every_package_is_installed() -> None:
    """pyproject.toml's package discovery finds each package folder: one left out is missing from a non-editable
    install."""
    import tomllib

    from setuptools import find_packages

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    listed = set(find_packages(str(ROOT), include=found["include"]))
    folders = {".".join(init.parent.relative_to(ROOT).parts)
               for top in ("layers", "memory_model", "streamer") for init in (ROOT / top).rglob("__init__.py")}
    assert folders == listed, (sorted(folders - listed), sorted(listed - folders))


# A comparison against a tier's name: `== "disk"`, `"ram" !=`, `in ("ram", ...)`, `in ["disk"]`, `"ram" in tiers`.
TIER_NAME_COMPARE = re.compile(r"""[=!]= *['"](ram|disk)['"]|['"](ram|disk)['"] *[=!]=|in [({\[]['"](ram|disk)"""
                               r"""|['"](ram|disk)['"] +(not +)?in\b""")


def test_only_the_tier_module_compares_tier_names() -> None:
    """The code asks a tier's traits (memory_model/tiers.py), so a new tier is one record and one back end."""
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for name, path in MODULES.items()
             if name != "memory_model.tiers"
             for n, line in enumerate(path.read_text().splitlines(), 1) if TIER_NAME_COMPARE.search(line)]
    assert not found, "\n".join(found)


# A `type: ignore` names the error it silences and says why on its line.
IGNORE_WITH_REASON = re.compile(r"# type: ignore\[[a-z-]+(, *[a-z-]+)*\]  # \S")
MAX_IGNORES = 10


def test_the_checked_code_ignores_few_type_errors_each_with_a_reason() -> None:
    """The code mypy checks (pyproject.toml's [tool.mypy] files) holds at most 10 `type: ignore`, each with its
    error code and a reason on its line."""
    import tomllib

    checked = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    ignores = [(f"{path.relative_to(ROOT)}:{n}", line) for folder in checked
               for path in sorted((ROOT / folder).rglob("*.py"))
               for n, line in enumerate(path.read_text().splitlines(), 1) if "type: ignore" in line]
    assert len(ignores) <= MAX_IGNORES, [where for where, _ in ignores]
    assert not [where for where, line in ignores if not IGNORE_WITH_REASON.search(line)]


def _wiring_takers() -> dict[str, int]:
    """Each class of streamer whose constructor takes the runtime's wiring (a first argument typed `Runtime`, or
    the transport's `Wiring`): its constructor's arguments, self left out."""
    out = {}
    for name, path in MODULES.items():
        if not name.startswith("streamer."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None) \
                if isinstance(node, ast.ClassDef) else None
            if init is None:
                continue
            args = init.args.posonlyargs + init.args.args + init.args.kwonlyargs
            if len(args) > 1 and args[1].annotation is not None and ast.unparse(args[1].annotation) in ("Runtime",
                                                                                                       "Wiring"):
                out[f"{name}.{node.name}"] = len(args) - 1 + bool(init.args.vararg) + bool(init.args.kwarg)
    return out


def test_the_runtimes_collaborators_take_the_wiring_and_few_more() -> None:
    """The runtime is wired once (`streamer.runtime.wiring.Runtime`); each collaborator takes it whole and at
    most three other parts, instead of a dozen settings each."""
    takers = _wiring_takers()
    assert {"Executor", "Loader", "Passes", "Updater", "Transport", "StepPolicy", "Persistence"} <= \
        {name.rsplit(".", 1)[1] for name in takers}
    assert {name: n for name, n in takers.items() if n > 4} == {}
