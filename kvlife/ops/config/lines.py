"""Line numbers of the keys and tables of a TOML text, by path.

:mod:`tomllib` returns plain dicts with no positions, so ``kvlife config check`` finds
where each value was written with this small scanner of the same text: table headers
(``[a.b]``, ``[[tiers]]`` with each array entry's index), keys (bare, quoted and dotted)
and the keys of one-line inline tables. Multi-line strings and arrays are skipped, so a
``key = value`` inside one is never taken for a key. A path that was not written (a
missing key) maps to the nearest written table above it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Path = tuple[str | int, ...]
"""A value's place: table and key names, and array indices (``("tiers", 1, "budget")``)."""

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def format_path(path: Sequence[str | int]) -> str:
    """``tiers[1].budget``; a key that is not bare is quoted (``quotas."user:alice"``)."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        name = part if _BARE.fullmatch(part) else '"' + part.replace('"', '\\"') + '"'
        out += ("." if out else "") + name
    return out


def _keys(text: str, pos: int) -> tuple[list[str], int]:
    """A dotted key starting at ``pos``: its parts and the position after it."""
    parts: list[str] = []
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t":
            pos += 1
        if pos < n and text[pos] in "\"'":
            quote = text[pos]
            end = pos + 1
            buf = ""
            while end < n and text[end] != quote:
                if quote == '"' and text[end] == "\\" and end + 1 < n:
                    buf += text[end + 1]
                    end += 2
                    continue
                buf += text[end]
                end += 1
            parts.append(buf)
            pos = end + 1
        else:
            m = _BARE.match(text, pos)
            if m is None:
                return parts, pos
            parts.append(m.group())
            pos = m.end()
        while pos < n and text[pos] in " \t":
            pos += 1
        if pos < n and text[pos] == ".":
            pos += 1
            continue
        return parts, pos


def _inline(text: str, pos: int, base: Path, line: int, out: dict[Path, int]) -> None:
    """Keys of a one-line inline table opening at ``pos`` (``{`` consumed), recursively."""
    n = len(text)
    while pos < n:
        keys, pos = _keys(text, pos)
        if not keys or pos >= n or text[pos] != "=":
            return
        here = (*base, *keys)
        out.setdefault(here, line)
        pos += 1
        while pos < n and text[pos] in " \t":
            pos += 1
        if pos < n and text[pos] == "{":
            _inline(text, pos + 1, here, line, out)
            depth = 0
            while pos < n:  # skip the nested table
                depth += text[pos] == "{"
                depth -= text[pos] == "}"
                pos += 1
                if depth == 0:
                    break
        else:  # skip the value up to the next comma at this level
            depth = 0
            while pos < n:
                c = text[pos]
                if c in "[{":
                    depth += 1
                elif c in "]}":
                    if depth == 0:
                        return
                    depth -= 1
                elif c == "," and depth == 0:
                    break
                elif c in "\"'":
                    end = text.find(c, pos + 1)
                    pos = n if end < 0 else end
                pos += 1
        pos += 1


def line_index(text: str) -> dict[Path, int]:
    """Every table and key written in ``text`` (valid TOML) -> its line (1-based)."""
    out: dict[Path, int] = {}
    counts: dict[Path, int] = {}
    table: Path = ()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i]
        lineno = i + 1
        i += 1
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("[["):
            names, _ = _keys(s, 2)
            key = tuple(names)
            index = counts.get(key, 0)
            counts[key] = index + 1
            table = (*_resolve(key, counts), index)
            out.setdefault(table, lineno)
            out.setdefault(table[:-1], lineno)
            continue
        if s.startswith("["):
            names, _ = _keys(s, 1)
            table = _resolve(tuple(names), counts)
            out.setdefault(table, lineno)
            continue
        keys, pos = _keys(s, 0)
        if not keys or pos >= len(s) or s[pos] != "=":
            continue
        path = (*table, *keys)
        out.setdefault(path, lineno)
        rest = s[pos + 1 :].lstrip()
        if rest.startswith("{"):
            _inline(rest, 1, path, lineno, out)
        # a value that goes on over several lines: skip to its end
        for opener, closer in (('"""', '"""'), ("'''", "'''")):
            if rest.startswith(opener) and rest.count(closer) == 1:
                while i < len(lines) and closer not in lines[i]:
                    i += 1
                i += 1
        if rest.startswith("[") and _depth(rest) > 0:
            depth = _depth(rest)
            while i < len(lines) and depth > 0:
                depth += _depth(lines[i])
                i += 1
    return out


def _depth(text: str) -> int:
    """Brackets opened minus closed on a line, outside strings and comments."""
    depth = 0
    quote = ""
    for c in text:
        if quote:
            if c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c == "#":
            break
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
    return depth


def _resolve(names: Path, counts: dict[Path, int]) -> Path:
    """A header's path with the index of each array of tables it is under
    (``[tiers.options]`` after the second ``[[tiers]]`` is ``tiers[1].options``)."""
    out: list[str | int] = []
    for j, name in enumerate(names):
        out.append(name)
        prefix = tuple(names[: j + 1])
        if j < len(names) - 1 and prefix in counts:
            out.append(counts[prefix] - 1)
    return tuple(out)


def line_of(index: dict[Path, int], path: Path) -> int:
    """The line of ``path``, else of the nearest written table or key above it (1 when
    nothing of it was written)."""
    for end in range(len(path), 0, -1):
        found = index.get(path[:end])
        if found is not None:
            return found
    return 1
