"""The base of every config model: unknown keys, bad values and NaN are errors; field docstrings are the docs."""
from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


def no_credentials(url: str | None) -> str | None:
    """URLs never carry a user or password: they would be echoed in logs, saved configs and compiled pipelines."""
    if url and "://" in url and (urlsplit(url).username or urlsplit(url).password):
        raise ValueError("must not contain a user name or password: give credentials through the environment")
    return url


