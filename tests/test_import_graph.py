"""The project's import graph: no import circles, and the layering rules of
docs/internals/architecture.md.

Read with ``ast`` from the source (nothing is imported, so it runs in well under a second). Every
``import`` counts, also those inside functions: a lazy import that closes a circle is still a
circle, only one that fails later (``if TYPE_CHECKING:`` imports are not run, so they do not).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the product: packages and top-level scripts (tests, bench and docs are not imported by it)
PACKAGES = ("contract", "converters", "energon_tasks", "models", "recipes")
SCRIPTS = ("train.py", "eval.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    files = [REPO / name for name in SCRIPTS]
    for package in PACKAGES:
        files += sorted((REPO / package).rglob("*.py"))
    return {_module_name(path): path for path in files}


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Project modules one import statement loads (``from p import m``: the submodule p.m when
    there is one, else p)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    else:
        return set()
    return {name for name in names if name in known}


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (``type_only``: the
    ``if TYPE_CHECKING:`` imports too)."""
    sources = _sources()
    known = set(sources)
    graph = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        nodes = ast.walk(tree) if type_only else _runtime_nodes(tree)
        graph[module] = {target for node in nodes
                         for target in _targets(node, module, is_package, known)} - {module}
    return graph


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                stack += child.orelse
            else:
                stack.append(child)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return [*path[path.index(child):], child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
    cycle = find_cycle(import_graph(type_only=True))  # annotations only: no circle of types
    assert cycle is None, "import circle through TYPE_CHECKING imports: " + " -> ".join(cycle)


def test_find_cycle_sees_lazy_imports(tmp_path):
    """The checker itself: a circle closed by an import inside a function is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert find_cycle(graph) is None
    tree = ast.parse("def f():\n    from pkg import a\n")
    lazy = {t for node in ast.walk(tree) for t in _targets(node, "pkg.c", False,
                                                             {"pkg.a", "pkg.c"})}
    assert lazy == {"pkg.a"}
    assert find_cycle({**graph, "c": lazy and {"a"}}) == ["a", "b", "c", "a"]


def test_layering():
    """models and energon_tasks never import each other, nor converters, nor the recipe layer,
    nor the scripts; contract (the neutral layer both sides share) imports nothing of the
    project; recipes (the wiring) may import every room, and only the scripts import it."""
    rest = ("recipes", "train", "eval")
    forbidden = {"models": ("energon_tasks", "converters", *rest),
                 "energon_tasks": ("models", "converters", *rest),
                 "converters": rest,
                 "contract": ("models", "energon_tasks", "converters", *rest)}
    problems = [f"{module} imports {target}"
                for module, targets in import_graph().items()
                for target in targets
                if target.split(".")[0] in forbidden.get(module.split(".")[0], ())]
    assert not problems, "; ".join(problems)


#: the rooms of models/ (docs/internals/architecture.md "models/"): what each may not import. The
#: foundations and building blocks know no family, checkpoint, HF folder or generation loop
#: (``models.flops`` asks the family registry for the formulas); the families use the HF mapping
#: helpers only; generation takes a built model; nothing in models/ imports the HF command line.
FILES = ("models.checkpointing", "models.hf", "models.generation", "models.convert")
MODEL_ROOMS = {
    **{room: ("models.families", *FILES) for room in (
        "models.cpu", "models.kernels", "models.parallel", "models.model_config",
        "models.layers", "models.multimodal", "models.lora", "models.vision_dp")},
    "models.flops": FILES,
    "models.families": ("models.checkpointing", "models.hf.export", "models.hf.source",
                        "models.hf.verify_inputs", "models.generation", "models.convert"),
    "models.generation": ("models.checkpointing", "models.hf", "models.convert"),
    "models.checkpointing": ("models.generation", "models.convert"),
    "models.hf": ("models.generation", "models.convert"),
}


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def room_problems(graph: dict[str, set[str]]) -> list[str]:
    """``a imports b`` for every import that breaks ``MODEL_ROOMS``."""
    return [f"{module} imports {target}"
            for module, targets in graph.items()
            for room, forbidden in MODEL_ROOMS.items() if _in(module, room)
            for target in sorted(targets) if any(_in(target, f) for f in forbidden)]


def test_models_rooms():
    """Every module of models/ is in a room, and the rooms keep their order; the checker finds a
    planted layer that loads a checkpoint."""
    graph = import_graph()
    homeless = [m for m in graph if _in(m, "models") and m != "models"
                and not any(_in(m, room) for room in (*MODEL_ROOMS, "models.convert"))]
    assert not homeless, homeless
    assert room_problems(graph) == []
    planted = {"models.layers.planted": {"models.checkpointing.checkpoint", "models.kernels"}}
    assert room_problems(planted) == [
        "models.layers.planted imports models.checkpointing.checkpoint"]


def _family_package(module: str) -> str | None:
    """``models.families.qwen_vl.model`` -> ``models.families.qwen_vl``; None outside one."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 2 and parts[1] == "families" else None


def test_family_packages_import_no_other_family():
    """Shared pieces live in neutral modules: a family package never imports another one."""
    problems = [f"{module} imports {target}"
                for module, targets in import_graph().items()
                for target in targets
                if _family_package(module) and _family_package(target)
                and _family_package(target) != _family_package(module)]
    assert not problems, "; ".join(problems)


def family_name_comparisons(sources: dict[str, Path]) -> list[str]:
    """``module:line`` of every comparison with a string naming a family (qwen..., nemotron...)
    in a product module outside the family packages and the neutral names (``contract``)."""
    import re

    names = re.compile(r"(qwen|nemotron)", re.I)
    hits = []
    for module, path in sources.items():
        if _family_package(module) or module.split(".")[0] == "contract":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            values = [c for side in sides for c in (side, *getattr(side, "elts", ()))]
            if any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                   and names.search(c.value) for c in values):
                hits.append(f"{module}:{node.lineno}")
    return hits


def test_no_family_name_comparisons_outside_the_family_packages(tmp_path):
    """What differs between families is asked of the family (its package, profile, geometry or
    hooks), never decided by comparing with its name; the checker itself finds one."""
    assert family_name_comparisons(_sources()) == []
    planted = tmp_path / "planted.py"
    planted.write_text("def f(cfg):\n    return cfg.family == 'nemotron_omni'\n")
    assert family_name_comparisons({"recipes.planted": planted}) == ["recipes.planted:2"]
