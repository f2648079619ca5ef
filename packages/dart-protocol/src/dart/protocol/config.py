"""Config base types.

Each component owns a pydantic config model derived from :class:`ConfigModel`, beside the code it
configures; a run's YAML file composes them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """Base of every config model: unknown keys are errors, defaults are validated too."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)
