"""Prompts drawn as the paths of a random tree, for the prefix-tree policies' tests."""

from __future__ import annotations


def prompt_paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-node path of the tree where node ``i + 1``'s parent is
    ``min(parents[i], i)`` (node 0 the root): one prompt per node, in node order."""
    par: dict[int, int | None] = {0: None}
    par.update({i + 1: min(p, i) for i, p in enumerate(parents)})
    out: list[list[int]] = []
    for node in par:
        path: list[int] = []
        k: int | None = node
        while k is not None:
            path.append(k)
            k = par[k]
        out.append(path[::-1])
    return out
