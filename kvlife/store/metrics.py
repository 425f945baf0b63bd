"""What ``info`` reports (objects by state, per-tier figures, counters) and the lifetime
counters kept by a tier that persists them."""

from __future__ import annotations

from collections.abc import Callable

from kvlife.core.lifecycle import ObjectState
from kvlife.core.objects import TierName
from kvlife.results import StoreInfo, TierInfo
from kvlife.store.core import StoreCore
from kvlife.tiers.base import PersistsCounters


def counter_store(core: StoreCore) -> PersistsCounters | None:
    """The first tier that persists counters, if any."""
    for tier in core.chain:
        if isinstance(tier, PersistsCounters):
            return tier
    return None


def load_lifetime(core: StoreCore) -> dict[str, int]:
    keeper = counter_store(core)
    return keeper.load_counters() if keeper is not None else {}


def save_lifetime(core: StoreCore, base: dict[str, int]) -> None:
    """Persist the lifetime counters, in a sequencer turn of their own: the catalog is
    written in plan order only."""
    keeper = counter_store(core)
    if keeper is None:
        return
    with core.seq.turn(core.seq.take()):
        with core.lock:
            total = core.counters.add(base).as_dict()
        keeper.save_counters(total)


def info(core: StoreCore, base: dict[str, int]) -> StoreInfo:
    core.check_open()
    with core.lock:
        by_state: dict[str, int] = {s.value: 0 for s in ObjectState}
        bytes_by_state: dict[str, int] = {s.value: 0 for s in ObjectState}
        for rec in core.index:
            if rec.state is not None and rec.state is not ObjectState.TENTATIVE:
                by_state[rec.state.value] += 1
                bytes_by_state[rec.state.value] += rec.nbytes
        by_state[ObjectState.TENTATIVE.value] = core.ledger.tentative
        tiers = [
            TierInfo(
                t.name,
                t.capacity_bytes,
                t.used_bytes,
                len(t.replica_keys()),
                {"durability": t.durability.value, **_transform_of(core, t.name), **t.details()},
            )
            for t in core.chain
        ]
        return StoreInfo(
            str(core.path),
            tiers,
            by_state,
            bytes_by_state,
            core.counters.as_dict(),
            core.counters.add(base).as_dict(),
        )


def _transform_of(core: StoreCore, tier: str) -> dict[str, object]:
    """A transforming tier's transform and parameters (nothing for a plain tier)."""
    t = core.encoders.get(TierName(tier))
    if t is None:
        return {}
    return {"transform": t.name, "transform_params": dict(t.params())}


def by_namespace(
    core: StoreCore, label: Callable[[str], str]
) -> tuple[dict[str, tuple[dict[str, int], dict[str, int], dict[str, int]]], int]:
    """Per namespace label (``label`` of each object's namespace text: a metrics
    exporter aggregates there): objects by state, their bytes by state, and the bytes
    of their replicas in each tier; and the TENTATIVE objects (the ledger's count, in
    no namespace's figures). One pass over the index under the lock, as :func:`info`."""
    core.check_open()
    out: dict[str, tuple[dict[str, int], dict[str, int], dict[str, int]]] = {}
    labels: dict[str, str] = {}
    with core.lock:
        for rec in core.index:
            state = rec.state
            if state is None or state is ObjectState.TENTATIVE:
                continue
            text = rec.info.namespace
            name = labels.get(text)
            if name is None:
                name = labels[text] = label(text)
            got = out.get(name)
            if got is None:
                got = out[name] = ({}, {}, {})
            objects, nbytes, tiers = got
            objects[state.value] = objects.get(state.value, 0) + 1
            nbytes[state.value] = nbytes.get(state.value, 0) + rec.nbytes
            for tier, rep in rec.replicas.items():
                tiers[tier] = tiers.get(tier, 0) + rep.nbytes
        tentative = core.ledger.tentative
    return out, tentative
