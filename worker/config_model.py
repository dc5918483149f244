"""The base class for every configuration section: unknown keys are an error, values are frozen.

Lives in ``worker`` because backends and executors declare their own option models here and the
supervisor's config composes them (the import direction is supervisor → worker).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# what a model's, a pipeline's or a step's name may be (it appears in paths and metric labels)
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class StrictModel(BaseModel):
    """A config section: a typo is an error, not a silently ignored key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
