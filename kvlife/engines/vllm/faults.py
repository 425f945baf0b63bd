"""A test hook in the connector's layer callbacks: raise inside vLLM's forward at a
chosen layer, as an out-of-memory or a kernel error would, to check that nothing the
failed step computed is ever stored; or inside the worker's copy of a load into the
paged cache, as a bug in the scatter would, to check that the load becomes load errors
and the step goes on (``kvlife.fail_layer`` in the connector's extra config; never set
in production)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlife.core.errors import InvalidArgument

PHASES = ("load", "save", "copy")


class InjectedForwardError(RuntimeError):
    """The failure :class:`LayerFault` raises (not a kvlife error: it stands for the
    engine's own, or a bug's)."""


@dataclass(slots=True)
class LayerFault:
    """Raise once, at layer ``layer`` (index among the worker's KV layers), in the
    first step that has work of ``phase``: ``"load"`` in ``wait_for_layer_load`` of a
    step with loads (before the layer's attention), ``"save"`` in ``save_kv_layer`` of
    a step with saves (after it), ``"copy"`` in the loader thread's copy of a step's
    loads into the layer group (or layer) holding ``layer``, before that copy starts
    (the groups before it already written)."""

    phase: str
    layer: int
    fired: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES or self.layer < 0:
            raise InvalidArgument(
                f"layer fault must be one of {PHASES} at a layer >= 0, got "
                f"{self.phase!r} at {self.layer}"
            )

    @classmethod
    def parse(cls, text: str) -> LayerFault:
        """``"save:1"``, ``"load:0"``, ``"copy:1"``."""
        phase, _, layer = text.partition(":")
        if not layer.isdigit():
            raise InvalidArgument(f"kvlife.fail_layer must be PHASE:LAYER, got {text!r}")
        return cls(phase, int(layer))

    def check(self, phase: str, layer: int) -> None:
        if self.fired or phase != self.phase or layer != self.layer:
            return
        self.fired = True
        where = "the loader's copy" if phase == "copy" else "forward"
        raise InjectedForwardError(f"kvlife test hook: {where} failed at {phase} of layer {layer}")
