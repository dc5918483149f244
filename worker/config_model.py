"""The base class for every configuration section: unknown keys are an error, values are frozen.

Lives in ``worker`` because backends and executors declare their own option models here and the
supervisor's config composes them (the import direction is supervisor → worker).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: a typo is an error, not a silently ignored key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
