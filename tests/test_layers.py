"""The import rules between the project's layers and the house's size limits (docs/architecture.md §2), read from
the source: the service (`gateway/`) imports neither the command line and its demo, the example agents, the
reference trainer nor the engine simulator; the routers (`gateway/api/`) import nothing of the process level (they see
the running gateway through `gateway.api.context.ApiServices`); engine adapters import nothing of the gateway; the
shared utilities (`common/`) import none of the project's other packages; the domain imports no HTTP layer;
`gateway/` has no import cycle, no folder of more than 20 modules, and no package a module of more than 600 lines."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests import REPO

ROOT = REPO


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def offenders(folder: str, forbidden: tuple[str, ...], exempt: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(exempt):
            continue
        for module in sorted(imported_modules(path)):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{relative} imports {module}")
    return bad


@pytest.mark.parametrize(
    ("folder", "forbidden", "exempt"),
    [
        ("gateway", ("rollout_agents", "trainers", "rollout_cli", "backends.sim", "backends.launcher"), ()),
        ("gateway/api", ("gateway.services", "gateway.app", "gateway.server", "gateway.workers"), ()),
        ("backends", ("gateway", "rollout_agents", "trainers"), ()),
        ("common", ("gateway", "backends", "rollout_agents", "trainers"), ()),
    ],
)
def test_a_layer_imports_nothing_above_it(folder: str, forbidden: tuple[str, ...], exempt: tuple[str, ...]) -> None:
    assert offenders(folder, forbidden, exempt) == []


def test_only_the_wiring_imports_the_fast_path() -> None:
    """The fast path (`gateway/fastpath/`) is chosen where the gateway is assembled, from `settings.fastpath`; no
    domain module depends on it, so turning it off leaves nothing half on."""
    wiring = ("gateway/fastpath/", "gateway/app.py", "gateway/services.py", "gateway/server.py")
    assert offenders("gateway", ("gateway.fastpath",), wiring) == []
    assert offenders("backends", ("gateway.fastpath",)) == []


def test_the_rule_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from backends.sim.server import SimReplica\n    import rollout_agents.runner\n")
    assert imported_modules(module) == {"backends.sim.server", "rollout_agents.runner"}


MAX_MODULE_LINES = 600
MAX_MODULES_PER_FOLDER = 20
PROCESS_LEVEL = ("gateway/app.py", "gateway/server.py", "gateway/services.py", "gateway/workers.py")
"""Where the gateway is assembled: with `gateway/api/` and `gateway/fastpath/`, all of the service that is not its
domain."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(folder: str) -> dict[str, set[str]]:
    """Module -> the modules of `folder` it imports (`from package import module` counts as importing the module)."""
    paths = {module_name(path): path for path in sorted((ROOT / folder).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in targets if target in paths and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                found.append(sorted([*component, node]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def oversized(folders: Iterable[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]


def test_no_module_is_over_600_lines() -> None:
    assert oversized(["gateway", "backends", "common", "trainers"]) == []


def test_no_folder_of_the_gateway_holds_more_than_20_modules() -> None:
    crowded = {}
    for folder in [ROOT / "gateway", *(p for p in (ROOT / "gateway").rglob("*") if p.is_dir())]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded[folder.relative_to(ROOT).as_posix()] = len(modules)
    assert crowded == {}


def test_the_gateway_has_no_import_cycle() -> None:
    assert cycles(import_graph("gateway")) == []


def test_the_domain_imports_no_http_layer() -> None:
    """The domain (every module of `gateway/` outside `api/`, `fastpath/` and the process level) speaks its own types:
    each protocol's adapter maps its models to them."""
    outside = ("gateway/api/", "gateway/fastpath/", *PROCESS_LEVEL)
    assert offenders("gateway", ("gateway.api",), outside) == []


def test_the_benchmarks_pages_are_at_most_250_lines() -> None:
    pages = [ROOT / "docs" / "benchmarks.md", *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
    assert {page.name: n for page in pages if (n := len(page.read_text().splitlines())) > 250} == {}


def test_the_rules_see_a_cycle_and_a_long_module(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
