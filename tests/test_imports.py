"""The project's import graph has no cycle, and the library never imports Prefect.

Edges are the imports a module can run: at module level and inside functions
(a late import still ties two modules together); those under ``if
TYPE_CHECKING:`` never run. ``from package import name`` is an edge to
``package.name`` when that is a module of the project, else to the package
itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("diffprep", "flows", "tasks", "blocks")


def module_name(path: Path) -> str:
    """The name a module is imported by: flows/, tasks/ and blocks/ install as diffprep.flows and so on."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] != "diffprep":
        parts.insert(0, "diffprep")
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


# The packages along the data's path, lowest first: each imports only those before it (and itself), not even for
# an annotation. The root keeps errors and contract, which every module uses; the face (diffprep/__init__.py,
# __main__.py) comes last.
LAYERS = ("root", "config", "sources", "media", "writer", "output", "families", "report", "run", "encodings",
          "validation", "captions", "phases", "tools", "blocks", "tasks", "flows", "cli", "face")


def layer(module: str) -> str:
    """``diffprep.<package>...`` -> its package; the root's modules and the face by name."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "face"
    if len(parts) == 2 and parts[1] in ("errors", "contract"):
        return "root"
    return parts[1]


def _executed_imports(tree: ast.Module, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level or inside functions, not under ``if TYPE_CHECKING:``
    (``typing``: those too)."""
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None) if isinstance(node, ast.If) else None
        if test is not None and (getattr(test, "id", None) == "TYPE_CHECKING"
                                 or getattr(test, "attr", None) == "TYPE_CHECKING"):
            typing_only.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return [node for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and (typing or id(node) not in typing_only)]


def import_graph(typing: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``typing``: annotation-only imports too)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _executed_imports(ast.parse(path.read_text(encoding="utf-8")), typing):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                # "import a.b.c" imports a.b.c; the nearest project module named is the edge.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_finds_a_planted_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_project() -> None:
    graph = import_graph()
    assert "diffprep.output.base" in graph and graph["diffprep.output.s3"] >= {"diffprep.output.base"}
    assert cycles(graph) == []


def test_no_import_cycle_even_through_annotations() -> None:
    assert cycles(import_graph(typing=True)) == []


def test_packages_import_one_way_down_the_data_path() -> None:
    """No package imports one after it in ``LAYERS`` (annotation-only imports included), and every module of
    the library sits in one of them: a module at the package root is errors, contract or the face."""
    graph = import_graph(typing=True)
    assert {layer(name) for name in graph} <= set(LAYERS), sorted({layer(name) for name in graph} - set(LAYERS))
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if rank[layer(target)] > rank[layer(name)])
    assert upward == []
    assert layer("diffprep.writer.shards") == "writer" and layer("diffprep.errors") == "root"


def test_every_package_is_installed_under_diffprep() -> None:
    """pyproject.toml lists the packages by hand (the Prefect layer maps into diffprep.*): none may be missing."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packages = {module_name(path.parent) for package in PACKAGES for path in (ROOT / package).rglob("__init__.py")}
    assert sorted(packages) == sorted(setuptools["packages"])
    assert {name for name in packages
            if name.count(".") == 1 and not (ROOT / "diffprep" / name.split(".")[1]).is_dir()} \
        == {"diffprep.flows", "diffprep.tasks", "diffprep.blocks"}


def test_the_library_does_not_import_prefect() -> None:
    offenders = []
    for name, path in project_modules().items():
        if name.split(".")[1:2] in (["flows"], ["tasks"], ["blocks"]):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "prefect" for a in node.names):
                offenders.append(name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "prefect":
                offenders.append(name)
    # The CLI starts the flows; nothing else in the library may know Prefect.
    assert sorted(set(offenders)) == []


def test_the_command_line_is_parsed_before_torch_or_prefect_load() -> None:
    """Every ``diffprep`` command builds its parser first: a module that pulled torch in there (2 s on 2 cores)
    delayed every command, and a terminal run's embedded server could not start until it was loaded."""
    import subprocess
    import sys

    probe = ("import sys; from diffprep.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'prefect', 'diffusers', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr


def test_writing_a_dataset_does_not_load_energon_or_boto3() -> None:
    """The pipeline and every encoding import without megatron-energon (and its multistorageclient): 0.7 s of a
    run's start-up that only finalize, validation and the training-side task encoders need (issue #29), nor
    boto3's session machinery, which only a bucket needs; each
    encoding's ``task_encoder`` still gives a working one (sd_vae's datasets are edm-zip archives, not Energon's)."""
    import subprocess
    import sys

    probe = ("import sys; import diffprep.phases.pipeline, diffprep.encodings as e; "
             "print(sorted(m for m in ('megatron.energon', 'multistorageclient', 'boto3') if m in sys.modules)); "
             "print(all(e.get_encoding(name).task_encoder().cookers for name in e.ENCODINGS if name != 'sd_vae'))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.split("\n")[:2] == ["[]", "True"], loaded.stdout + loaded.stderr
