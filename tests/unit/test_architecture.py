"""The rooms of the package and what they may import, checked by walking every import statement (module-level and
inside functions): a stage never imports another stage, and no two modules import each other, directly or around a
circle."""
import ast
from pathlib import Path

import rlaif

ROOT = Path(rlaif.__file__).parent


def module_name(path: Path) -> str:
    parts = ["rlaif", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The rlaif modules a file imports (`from rlaif.io import storage` names rlaif.io.storage when it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rlaif")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlaif"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
    return {m for m in found if m in MODULES}


GRAPH = {name: imports(path) - {name} for name, path in MODULES.items()}


def test_stages_do_not_import_each_other():
    for name, deps in GRAPH.items():
        if name.startswith("rlaif.stages.") and name != "rlaif.stages.common":
            others = {d for d in deps if d.startswith("rlaif.stages.") and d != "rlaif.stages.common"}
            assert not others, f"{name} imports {others}: move what they share to models/, judges/, io/ or algo/"


def test_no_import_cycles():
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for dep in GRAPH[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_functions_fit_on_a_screen():
    """No function in rlaif/ over 60 lines: a longer one is a sequence of steps that want names."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{name}.{node.name} ({length} lines)")
    assert not long, f"split these into named steps: {long}"


def test_every_package_is_installed():
    """pyproject lists packages by name (components/ installs as rlaif_components): a new folder must be listed."""
    import tomllib

    repo = ROOT.parent
    listed = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    found |= {".".join(("rlaif_components", *p.parent.relative_to(repo / "components").parts)).rstrip(".")
              for p in (repo / "components").rglob("__init__.py")}
    assert listed == found
