"""What every configuration section shares: frozen, unknown keys refused, and the durations' type."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Seconds = Annotated[float, Field(gt=0)]


class Section(BaseModel):
    """A section of the configuration: immutable, and a key it does not know is an error that names it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
