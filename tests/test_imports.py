"""The package's import graph: no circles (imports inside functions count too), the trainer imports
no feature, and no module imports another package's private names."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ropelab"
TOOL = ROOT.parent / "shared" / "tools" / "import_cycles.py"
FEATURES = ("ropelab.distill", "ropelab.evaluate", "ropelab.probe", "ropelab.study", "ropelab.export", "ropelab.cli")


@pytest.fixture(scope="module")
def tool():
    if not TOOL.is_file():
        pytest.skip(f"{TOOL}: the shared import-cycle tool is not beside this checkout")
    spec = importlib.util.spec_from_file_location("import_cycles", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_no_import_circles(tool):
    found = tool.circles(tool.imports(PACKAGE))
    assert not found, f"import circles: {found}"


def test_a_planted_circle_is_reported(tool, tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x  # inside a function, relative\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert tool.circles(tool.imports(package)) == [["pkg.a", "pkg.sub.b"]]


def test_the_trainer_imports_no_feature(tool):
    graph = tool.imports(PACKAGE)
    trainer = [m for m in graph if m.startswith("ropelab.train")]
    reached, stack = set(), list(trainer)
    while stack:  # everything the training package reaches, directly or not
        for target in graph[stack.pop()]:
            if target not in reached:
                reached.add(target)
                stack.append(target)
    assert not [m for m in reached if m.startswith(FEATURES)]


def _private_imports(path: Path) -> list[str]:
    found = []
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ropelab"):
            source_package = node.module.rsplit(".", 1)[0] if "." in node.module else node.module
            own_package = module.rsplit(".", 1)[0]
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and source_package != own_package:
                    found.append(f"{module}:{node.lineno} imports {node.module}.{alias.name}")
    return found


def test_no_private_name_is_imported_from_another_package():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _private_imports(path)]
    assert not found, found
