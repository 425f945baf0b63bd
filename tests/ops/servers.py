"""A real ``kvlife serve --metrics`` for the ops tests, and a scrape of its metrics over
HTTP parsed with prometheus-client's own parser."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerProc, wait_for


def metrics_server(path: Path, *extra: str, bare: bool = False) -> tuple[ServerProc, str]:
    """A started ``kvlife serve PATH --metrics 127.0.0.1:0 ...`` (``bare``: ``--metrics``
    with no value, the same) and the URL its start line names."""
    flag = ("--metrics",) if bare else ("--metrics", "127.0.0.1:0")
    srv = ServerProc(path, extra=(*extra, *flag)).start()
    box: list[str] = []

    def named() -> bool:
        found = re.search(r'metrics[=":]+(http://[^ ",]+)', srv.log.read_text())
        if found:
            box.append(found.group(1))
        return bool(found)

    wait_for(named, 30, "the start line naming the metrics URL")
    return srv, box[0]


def scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as reply:
        text: str = reply.read().decode()
    return text


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample: (name, labels) -> value."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(scrape_text(url)):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]
