"""The base every recipe section is built on, and the field types its sections share.

Each section is strict: an unknown key is an error (the loader names the closest known one),
and a validated recipe is frozen.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


class Strict(BaseModel):
    """A recipe section: unknown keys refused, no inf or nan, frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("blank", "must not be blank (got '{v}')", {"v": value})
    return value


# A name the user types: a recipe, a model, a dataset, a column, a reward.
Identifier = Annotated[str, AfterValidator(_not_blank)]
