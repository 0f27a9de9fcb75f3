"""keel's import graph, built from the AST of every file in src/keel (module-level and function-level
imports alike): no cycle between files, no cycle between packages, every package importing only its own
layer or the layers below (docs/ARCHITECTURE.md), and argparse only in keel/cli/."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Lowest first: a package may import its own layer and the layers before it, never a later one.
LAYERS = [
    {
        "keel.errors",
        "keel.atomic",
        "keel.jsonl",
        "keel.paths",
        "keel.dtypes",
        "keel.dtype_names",
        "keel.lazy",
        "keel.net",
        "keel.version",
        "keel.platform",
        "keel.libc",
        "keel.kernels",
        "keel.config",
        "keel.families",
        "keel.catalog",
        "keel.tokenizer",
    },
    {"keel.model", "keel.data"},
    {"keel.weights"},
    {"keel.quant"},
    {"keel.plan"},
    {"keel.serve", "keel.train"},
    {"keel.eval", "keel.profile", "keel.tools"},
    {"keel.cli", "keel.__main__", "keel"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> dict[str, Path]:
    return {_module_name(p): p for p in (SRC / "keel").rglob("*.py")}


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, files: dict[str, Path]) -> list[str]:
    """The keel files an import statement loads (a `from package import submodule` names the submodule)."""

    def owner(name: str) -> str:
        while name not in files and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    if isinstance(node, ast.Import):
        return [owner(a.name) for a in node.names if a.name.split(".")[0] == "keel"]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != "keel":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in files else owner(base) for a in node.names]


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(file -> keel files it imports, file -> stdlib/third-party top-level modules it imports)."""
    files = _files()
    edges: dict[str, set[str]] = defaultdict(set)
    external: dict[str, list[str]] = defaultdict(list)
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(module, path.name == "__init__.py", node, files):
                    if target != module:
                        edges[module].add(target)
                if isinstance(node, ast.Import):
                    external[module] += [a.name.split(".")[0] for a in node.names]
                elif not node.level and node.module:
                    external[module].append(node.module.split(".")[0])
    return edges, external


def cycles(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def package_of(module: str) -> str:
    """keel.serve.parallel.worker -> keel.serve; keel.config -> keel.config; keel -> keel."""
    return ".".join(module.split(".")[:2])


def _layer(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"{package} is in no layer of LAYERS: add it to tests/test_package_graph.py and the map")


def test_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(["a", "b", "c", "d"], edges) == [["a", "b", "c"]]
    assert cycles(["a", "b"], {"a": {"b"}}) == []


def test_no_cycle_between_files():
    edges, _ = import_graph()
    assert cycles(sorted(_files()), edges) == []


def test_no_cycle_between_packages():
    edges, _ = import_graph()
    packages: dict[str, set[str]] = defaultdict(set)
    for source, targets in edges.items():
        for target in targets:
            if package_of(source) != package_of(target):
                packages[package_of(source)].add(package_of(target))
    assert cycles(sorted({package_of(m) for m in _files()}), packages) == []


def test_every_import_goes_down_the_layers():
    edges, _ = import_graph()
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if _layer(package_of(target)) > _layer(package_of(source))
    )
    assert upward == []


def test_argparse_only_in_the_cli_package():
    _, external = import_graph()
    outside = sorted(m for m, names in external.items() if "argparse" in names and package_of(m) != "keel.cli")
    assert outside == []
