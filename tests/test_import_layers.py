"""The package's stages import one way (function-level imports included), and no module imports
itself back through others: model -> transforms -> annotated trace -> scheduling -> report.

Each module belongs to the first layer whose prefix it starts with; a module may import from its
own layer and the layers below it, never above. ``testing`` (scaffolding) and the command line
sit on top: nothing in the library imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import thunder_overlap

PACKAGE = Path(thunder_overlap.__file__).parent

# Lowest first. A prefix names a module or a package (and everything in it).
LAYERS: list[tuple[str, ...]] = [
    ("thunder_overlap._console", "thunder_overlap._backends", "thunder_overlap._ops"),
    ("thunder_overlap._analysis",),
    ("thunder_overlap.config", "thunder_overlap.options", "thunder_overlap._process_groups"),
    ("thunder_overlap._scheduling",),
    ("thunder_overlap._bucketing",),
    ("thunder_overlap._transforms",),
    ("thunder_overlap.api", "thunder_overlap.plugin", "thunder_overlap.clip_grad"),
    ("thunder_overlap.report", "thunder_overlap.checkpoint"),
    ("thunder_overlap.fabric",),
    ("thunder_overlap.__init__", "thunder_overlap.__main__", "thunder_overlap.testing"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS: add it where it belongs")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module of this package, line) for every import statement, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from package import module" imports that module, not a name of the package's __init__.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "thunder_overlap" or name.startswith("thunder_overlap."):
                found.append((_resolve(name), node.lineno))
    return found


def _resolve(name: str) -> str:
    """The module a dotted name refers to: itself where it is a module, else the longest prefix
    that is (``package.name`` for a name the package's ``__init__`` defines)."""
    parts = name.split(".")
    while parts:
        candidate = PACKAGE.parent.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return "thunder_overlap.__init__" if parts == ["thunder_overlap"] else ".".join(parts)
        parts = parts[:-1]
    raise AssertionError(f"cannot resolve import of {name}")


def _graph() -> dict[str, list[tuple[str, int]]]:
    return {_module_name(path): _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_follows_the_layers():
    against = []
    for module, imports in _graph().items():
        for imported, line in imports:
            if _layer(imported) > _layer(module):
                against.append(f"{module}:{line} imports {imported} (layer {_layer(module)} -> {_layer(imported)})")
    assert not against, "imports against the flow:\n" + "\n".join(against)


def test_no_module_imports_itself_through_others():
    graph = {module: {imported for imported, _ in imports if imported != module} for module, imports in _graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                cycle = stack[stack.index(imported) :] + [imported]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_layer_check_sees_function_level_imports(tmp_path):
    # A test that cannot fail is a defect: an import inside a function is found too.
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from thunder_overlap._transforms.bucketing import BucketingTransform\n")
    assert _imports(source) == [("thunder_overlap._transforms.bucketing", 4)]
    assert _layer("thunder_overlap._transforms.bucketing") > _layer("thunder_overlap._analysis.classify")


def test_the_library_never_imports_its_testing_scaffolding():
    # The command line reaches the demo by name (importlib), which is not an import of the library.
    importers = [
        f"{module}:{line}"
        for module, imports in _graph().items()
        if not module.startswith("thunder_overlap.testing")
        for imported, line in imports
        if imported.startswith("thunder_overlap.testing")
    ]
    assert not importers, importers


def test_no_transform_imports_another():
    # Transforms share the model's state, not each other ([Note: model state]): a transform module
    # imports only the private modules beside it (the state, the lookup).
    transforms = "thunder_overlap._transforms"
    against = [
        f"{module}:{line} imports {imported}"
        for module, imports in _graph().items()
        if module.startswith(f"{transforms}.") and not module.rpartition(".")[2].startswith("_")
        for imported, line in imports
        if imported.startswith(f"{transforms}.") and not imported.rpartition(".")[2].startswith("_") and imported != module
    ]
    assert not against, against
