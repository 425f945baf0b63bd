"""Finalizers and the garbage collector: no ``__del__`` or weakref finalizer of kvlife
takes a lock or does I/O (docs/server.md, "Finalizers"), because the cyclic collector
runs them on whichever thread allocated when a collection fell due, and that thread may
hold the very lock (issue 19: the arena's allocator deadlocked the server for good).

- the arena survives a collection set off inside its own allocator, with extents whose
  last view sat in a reference cycle (a child process, so a deadlock fails the test
  instead of hanging it);
- an asynchronous load leaves no reference cycle behind: its output arrays (in the
  server, arena extents) die with their last reference, not at the next collection;
- the rule itself, checked on the source: every finalizer kvlife registers (weakref
  callbacks, ``__del__``) and every function of its class it calls, read as an AST, takes
  no lock and opens, writes, logs or prints nothing.
"""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvlife.server.server import ServeConfig, open_store
from kvlife.store import KVStore
from tests.conftest import TINY, prompt_kv, tiny_identity
from tests.server.conftest import ROOT, MiB, child_env

N = TINY.tokens_per_chunk

_COLLECT_INSIDE_ALLOC = r"""
import gc, tempfile
from pathlib import Path
import numpy as np
from kvlife.tiers.shm import Arena

arena = Arena(Path(tempfile.mkdtemp()) / "arena", 64 * 4096, populate_pages=False)


class Cycle:
    pass


alloc = arena.alloc  # bound once: no allocation of ours between here and its lock
for ahead in range(12):
    gc.disable()
    gc.collect()
    view = alloc(4096, np.uint8, (4096,))
    c = Cycle()
    c.me = c  # the view's last reference sits in a reference cycle
    c.view = view
    del view, c
    # a collection falls due a few allocations ahead: for some values of ``ahead``
    # inside the allocator, under its lock
    gc.set_threshold(gc.get_count()[0] + ahead)
    gc.enable()
    kept = alloc(4096, np.uint8, (4096,))
    assert kept is not None
    del kept
gc.set_threshold(700)
gc.collect()
print(arena.stats()["arena_extents"])
arena.unlink()
"""


def test_a_collection_inside_the_allocator_does_not_deadlock(tmp_path: Path) -> None:
    """Regression (issue 19, defect 1): ``Arena._free`` ran as a weakref finalizer of a
    view in a reference cycle, during a collection set off by an allocation under
    ``Arena._lock``, and waited for that non-reentrant lock forever."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _COLLECT_INSIDE_ALLOC],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the arena deadlocked: a finalizer waited for the allocator's lock")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"]  # every extent came back


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    s = open_store(ServeConfig(tmp_path / "store", dram_bytes=2 * MiB, disk_bytes=8 * MiB))
    yield s
    s.close()


@pytest.mark.parametrize("depth", [1, 2, None])
def test_an_async_load_leaves_no_reference_cycle(store: KVStore, depth: int | None) -> None:
    """Regression (issue 19, defect 1, its source): the ``read`` and ``submit_next``
    closures of a chained ``load_async`` referred to each other, so every load's items
    (the server's arena extents among them) lived until the cyclic collector ran."""
    ident = tiny_identity()
    from kvlife.core.identity import PUBLIC

    tokens, kv = prompt_kv(5, 4 * N)
    store.put_prompt(ident, PUBLIC, tokens, kv)
    store.evict("dram", 1 << 40)  # disk hits: the reads go through the I/O pool
    lookup = store.lookup(ident, PUBLIC, tokens)
    assert [h.tier for h in lookup.hits] == ["disk"] * 4
    outs = [np.empty(TINY.chunk_shape, np.float16) for _ in range(4)]
    alive = [weakref.ref(o) for o in outs]
    gc.collect()
    gc.disable()
    try:
        handle = store.load_async(lookup, outs, depth=depth)
        res = handle.wait(timeout=30)
        assert res.loaded == 4
        for i, arr in enumerate(res.arrays):
            assert np.array_equal(arr, kv[:, :, :, i * N : (i + 1) * N])
        store.drain()  # the promotion of the disk hits has run
        del handle, res, outs, arr
        assert [r() is None for r in alive] == [True] * 4, "held by a reference cycle"
    finally:
        gc.enable()


# ---------------------------------------------------------------------- the rule

KVLIFE = ROOT / "kvlife"
_IO_CALLS = {"open", "print", "unlink", "write", "write_text", "write_bytes", "fsync", "sendall"}
"""Calls a finalizer may not make (opening or writing files, the log, a socket)."""


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _forbidden(
    fn: ast.FunctionDef, methods: dict[str, ast.FunctionDef], seen: set[str]
) -> list[str]:
    """What ``fn``, or a method of its class it calls on ``self``, does that a finalizer
    must not: take a lock (``with ...lock...``, ``.acquire()``), open or write a file,
    log, print."""
    seen.add(fn.name)
    bad: list[str] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.With):
            for item in node.items:
                text = ast.unparse(item.context_expr).lower()
                if "lock" in text or "mutex" in text or "cond" in text:
                    bad.append(f"{fn.name} takes {ast.unparse(item.context_expr)}")
        elif isinstance(node, ast.Call):
            name = _name(node.func)
            if name in ("acquire", "wait") or name in _IO_CALLS or name.startswith("log"):
                bad.append(f"{fn.name} calls {ast.unparse(node.func)}")
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id == "self"
                and func.attr in methods
                and func.attr not in seen
            ):
                bad += _forbidden(methods[func.attr], methods, seen)
    return bad


def _finalizers() -> Iterator[tuple[str, ast.FunctionDef, dict[str, ast.FunctionDef]]]:
    """Every finalizer in kvlife: ``__del__`` methods, and the callbacks given to
    ``weakref.finalize`` / ``weakref.ref`` (a method of the same class, or a function of
    the same module)."""
    for path in sorted(KVLIFE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
            for name, fn in methods.items():
                if name == "__del__":
                    yield f"{path.relative_to(ROOT)}:{cls.name}.__del__", fn, methods
            for call in [n for n in ast.walk(cls) if isinstance(n, ast.Call)]:
                cb = _callback(call)
                if cb is None:
                    continue
                where = f"{path.relative_to(ROOT)}:{call.lineno}"
                if isinstance(cb, ast.Attribute) and _name(cb.value) == "self":
                    assert cb.attr in methods, f"{where}: finalizer {cb.attr} not found"
                    yield where, methods[cb.attr], methods
                elif isinstance(cb, ast.Name) and cb.id in functions:
                    yield where, functions[cb.id], {}
                else:
                    raise AssertionError(f"{where}: a finalizer this test cannot read")
        for stmt in [n for n in tree.body if isinstance(n, ast.Expr | ast.Assign)]:
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Call) and _callback(sub) is not None:
                    raise AssertionError(f"{path}: a module-level finalizer this test cannot read")


def _callback(call: ast.Call) -> ast.expr | None:
    func = call.func
    if not (isinstance(func, ast.Attribute) and _name(func.value) == "weakref"):
        return None
    if func.attr == "finalize" and len(call.args) >= 2:
        return call.args[1]
    if func.attr == "ref" and len(call.args) >= 2:
        return call.args[1]
    return None


def test_no_finalizer_takes_a_lock_or_does_io() -> None:
    found = list(_finalizers())
    # the two known ones are found (the scan reads what it means to read)
    assert any("tiers/shm.py" in w for w, _, _ in found), found
    assert any("tiers/buffers.py" in w for w, _, _ in found), found
    bad = {where: _forbidden(fn, methods, set()) for where, fn, methods in found}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_scan_sees_a_lock_taken_in_a_finalizer() -> None:
    """The check itself: a finalizer that locks through a helper method is caught."""
    tree = ast.parse(
        "class A:\n"
        "    def __init__(self):\n"
        "        weakref.finalize(self, self._free, 1)\n"
        "    def _free(self, n):\n"
        "        self._give(n)\n"
        "    def _give(self, n):\n"
        "        with self._lock:\n"
        "            pass\n"
    )
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert _forbidden(methods["_free"], methods, set()) == ["_give takes self._lock"]
