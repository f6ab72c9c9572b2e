"""The package's import graph: no module imports one that imports it back (at module
level or inside a function), and the actors never import the pipeline layer."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import ray_credit

PACKAGE = Path(ray_credit.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _lazy(package: str) -> dict[str, str]:
    """A package's names imported on first use (its ``_LAZY``: name -> module)."""
    return getattr(importlib.import_module(package), "_LAZY", {})


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (a name taken from a
    package's lazy exports counts as an import of the module that defines it)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        targets.append(f"{base}.{alias.name}")
                    elif base in modules and alias.name in _lazy(base):
                        targets.append(_lazy(base)[alias.name])
                    else:
                        targets.append(base)
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("ray_credit"):
                    graph[name].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back():
    loop = _cycle(import_graph())
    assert loop is None, "import loop: " + " -> ".join(loop)


def test_the_walk_sees_a_loop_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    # and it reads imports inside functions: the generator's of its weight group
    assert "ray_credit.actors.collective" in import_graph()["ray_credit.actors.generator"]


def test_actors_never_import_the_pipeline_layer():
    graph = import_graph()
    offending = {
        module: sorted(t for t in targets if t.startswith("ray_credit.pipeline"))
        for module, targets in graph.items()
        if module.startswith("ray_credit.actors")
    }
    assert {m: t for m, t in offending.items() if t} == {}


def test_examples_and_pipeline_scripts_use_public_names_only():
    """What a user copies from uses what a user may: no private module, no private name."""
    root = PACKAGE.parent
    private = []
    for path in [*root.glob("examples/*.py"), *root.glob("pipelines/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray_credit"):
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("ray_credit")]
            else:
                continue
            private += [
                f"{path.name}: {n}" for n in names if any(p.startswith("_") for p in n.split("."))
            ]
    assert private == []


def test_the_public_api_is_importable_from_the_package():
    names = (
        "Pipeline", "PipelineConfig", "LearnerGroup", "LearnerConfig", "GeneratorConfig",
        "RunConfig", "DataConfig", "EvalConfig", "JudgeConfig", "ResourcesConfig",
        "RetrieverConfig", "load_config", "train", "parse_config", "make_world",
        "estimator_stage", "actor_stage", "EMBEDDED_CONFIG",
    )  # fmt: skip
    missing = [name for name in names if getattr(ray_credit, name, None) is None]
    assert missing == []
    # the embedded settings ship inside the package, not beside a checkout's scripts
    assert ray_credit.EMBEDDED_CONFIG.is_file()
    assert PACKAGE in ray_credit.EMBEDDED_CONFIG.parents
