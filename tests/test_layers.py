"""Imports point down the layers of README's architecture picture, never up.

The layer map is here and only here (README's "Layers" block says the same in words). A
module may import from its own layer or a lower one. Every import counts, wherever it
is written: at module level, inside a function (a lazy import is still a dependency) and
under ``TYPE_CHECKING``. A new folder under ``kvlife/`` must be placed in the map first.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvlife"

FACE = "kvlife"
"""``kvlife/__init__.py``: the package's face (``kvlife.connect``); top layer, and it
imports nothing at module level (asserted below)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    # leaves over core: terminal tables, device models, the trace schema and importers,
    # the operations primitives (structured logs, live figures), the compiled code
    ("report", "sim", "trace", "interpreters", "native"),
    # building blocks; the global index on Redis is the shared tiers' index and sits
    # with them (record frames and tier names one way, invalidation rules the other);
    # tenancy (names, principals, scopes, quotas) is read by the store and the server
    ("index", "policy", "transforms", "tiers", "globalindex", "tenancy"),
    # the I/O-free placement engine; the typed results of the store's API; the
    # I/O-free load/decode/recompute planner (its plans are made of lookup results)
    ("placement", "results", "planner"),
    ("store",),
    # what runs a store: the server, trace replay (live mode opens a store), fault
    # injectors (they wrap the store's seams and drive it); operating it (ops: the
    # configuration file mapped onto the server's and the store's settings, the KV
    # events the server publishes)
    ("server", "replay", "faults", "ops"),
    # the server's client (it speaks the server's protocol)
    ("client",),
    # engine adapters (the vLLM connector reaches a served store through the client);
    # upstream: the prompt builder and segment reuse an application drives beside an
    # engine (it runs the model's layers and hands sources to the store)
    ("engines", "upstream"),
    ("experiments", "bench", "apps", "reporting"),
    ("cli", FACE),
)
LAYER = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}


@dataclass(frozen=True, slots=True)
class Arrow:
    module: str
    line: int
    target: str
    """The imported module (``kvlife.x.y``, or ``kvlife`` for the face)."""

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def folder_of(module: str) -> str:
    """``kvlife.store.facade`` -> ``store``; ``kvlife.results`` -> ``results``;
    ``kvlife`` -> the face."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACE


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(module: str, source: str, is_package: bool = False) -> list[Arrow]:
    """Every kvlife module ``source`` imports, anywhere in it."""
    out: list[Arrow] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Arrow(module, node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join([*here, base] if base else here)
            if base == FACE:
                # ``from kvlife import store`` names a folder; ``from kvlife import
                # connect`` names the face
                for a in node.names:
                    sub = ROOT / a.name
                    named = sub.is_dir() or sub.with_suffix(".py").is_file()
                    out.append(Arrow(module, node.lineno, f"kvlife.{a.name}" if named else FACE))
            else:
                out.append(Arrow(module, node.lineno, base))
    return [a for a in out if a.target == FACE or a.target.startswith(FACE + ".")]


def upward(arrows: list[Arrow]) -> list[Arrow]:
    """The arrows that point to a higher layer than their module's."""
    return [a for a in arrows if LAYER[folder_of(a.target)] > LAYER[folder_of(a.module)]]


def all_modules() -> list[tuple[str, str, bool]]:
    return [
        (module_name(p), p.read_text(encoding="utf-8"), p.name == "__init__.py")
        for p in sorted(ROOT.rglob("*.py"))
    ]


def test_every_folder_has_a_layer() -> None:
    folders = {folder_of(m) for m, _, _ in all_modules()}
    assert not folders - set(LAYER), f"place these in LAYERS: {sorted(folders - set(LAYER))}"
    assert not set(LAYER) - folders, f"no such folder: {sorted(set(LAYER) - folders)}"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    found = [a for m, src, pkg in all_modules() for a in upward(imports_of(m, src, pkg))]
    assert not found, "imports that point up the layers:\n" + "\n".join(map(str, found))


def test_the_face_imports_nothing_at_module_level() -> None:
    """Importing any part of kvlife runs ``kvlife/__init__.py``; it must not pull in the
    layers above that part."""
    tree = ast.parse((ROOT / "__init__.py").read_text(encoding="utf-8"))
    body = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    arrows = [a for n in body for a in imports_of(FACE, ast.unparse(n), is_package=True)]
    eager = [a.target for a in arrows]
    assert not eager, f"kvlife/__init__.py imports {eager} at module level"


@pytest.mark.parametrize(
    ("module", "source", "bad"),
    [
        ("kvlife.tiers.registry", "from kvlife.store.config import TierSpec", True),
        ("kvlife.store.facade", "def f():\n    from kvlife.client.remote import R\n", True),
        ("kvlife.engines.vllm.runner", "from kvlife.apps.chat import load_workload", True),
        ("kvlife.store.facade", "from kvlife import connect", True),
        ("kvlife.tiers.disk.tier", "from ...store import KVStore", True),
        ("kvlife.tiers.disk", "from ..registry import build_tier", False),
        ("kvlife.store.facade", "from kvlife.tiers.registry import build_tier", False),
        ("kvlife.bench.vllm_runner", "from kvlife.apps.chat import ChatEncoder", False),
        ("kvlife.cli", "import kvlife", False),
    ],
)
def test_the_checker_sees_an_upward_import(module: str, source: str, bad: bool) -> None:
    is_package = module == "kvlife.tiers.disk"
    assert bool(upward(imports_of(module, source, is_package))) is bad
