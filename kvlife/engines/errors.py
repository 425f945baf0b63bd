"""Typed errors of the engine adapters."""

from __future__ import annotations

from kvlife.core.errors import KVLifeError


class EngineError(KVLifeError):
    """The model or request cannot be served with kvlife (the message says why)."""


class UnsupportedModel(EngineError):
    """The model lacks what the adapter needs (a Llama-style config, a KV cache)."""


class ContextTooLong(EngineError, ValueError):
    """Prompt plus generated tokens exceed the model's context window."""


class IdentityMismatch(EngineError):
    """A model identity that does not describe the model it is used with."""
