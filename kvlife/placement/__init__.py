"""Placement: the I/O-free engine that decides where replicas go (see :mod:`.engine`)."""

from kvlife.placement.actions import Action, Copy, Drop, Evict, Place, Plan, Reject
from kvlife.placement.engine import Placement, Residency, TierSlot

__all__ = [
    "Action",
    "Copy",
    "Drop",
    "Evict",
    "Place",
    "Placement",
    "Plan",
    "Reject",
    "Residency",
    "TierSlot",
]
