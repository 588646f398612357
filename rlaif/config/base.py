"""The base of every config model: unknown keys, bad values and NaN are errors; field docstrings are the docs."""
from __future__ import annotations

import math
import struct
import types
from typing import Annotated, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator


def _non_empty(text: str) -> str:
    if not text:
        raise ValueError("holds an empty string, which would match everywhere: remove it")
    return text


def _non_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("holds an empty or blank phrase, which would match everywhere: remove it")
    return text


def refuse_edge_space(location: str | None) -> str | None:
    """A path, URL or model name as pasted: a space or line break at either end names another file or directory (a
    storage root of " " was a directory named " ")."""
    if location and location != location.strip():
        raise ValueError(f"{location!r} has a space or line break at its start or end: remove it")
    return location


# A string that is searched for in text: empty (a stop string), or blank (a keyword), it would match any text.
NonEmptyString = Annotated[str, AfterValidator(_non_empty)]
Phrase = Annotated[str, AfterValidator(_non_blank)]
Location = Annotated[str, AfterValidator(refuse_edge_space)]  # a file, directory, URL or hub model

PATTERN_WORDS: dict[str, str] = {}  # a field's regular expression -> what it asks for, in words, for its error
RUN_ID_PATTERN = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}"  # one directory name under the storage root


def described(regex: str, words: str) -> str:
    """A field's `pattern`, registered with the words its error says instead of the regular expression."""
    PATTERN_WORDS[regex] = words
    return regex


# Sampling divides logits by the temperature: far below this they overflow (NaN log-probs at 1e-40). vLLM samples
# greedily below it; the served API does the same, and stage settings refuse it.
MIN_TEMPERATURE = 1e-5


def _samplable(alternative: str):
    """A temperature check (0 itself is the field's range to allow or refuse); `alternative` ends its message."""
    def check(temperature: float) -> float:
        if 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"{temperature:g} is too small to sample with (logits / temperature overflow): use at "
                             f"least {MIN_TEMPERATURE:g}{alternative}")
        return temperature
    return check


Temperature = Annotated[float, AfterValidator(_samplable(""))]  # a sampling temperature (its field: > 0)
TemperatureOrGreedy = Annotated[float, AfterValidator(_samplable(", or 0 for greedy decoding"))]  # 0: greedy

RUNTIME = {"cache_key": False}  # json_schema_extra of a field that says how or where work runs, not what it computes


def runtime_field(default, **kwargs):
    """A setting that changes where or how a stage runs but never its output (a service's URL, a streaming switch):
    left out of the stage's cache key, so flipping it neither re-runs the stage nor changes its manifest digest."""
    return Field(default, json_schema_extra=RUNTIME, **kwargs)


def processes(stage: str) -> str:
    """How a stage's process count is set, for the errors of settings that must divide by it."""
    return f"the processes ({stage}.nproc on CPUs; one per GPU on GPUs, times the nodes)"


def without(keyed: dict, unread: set[str]) -> dict:
    """A section's cache-key dump without the settings its options never read (a cache_key_view's usual result)."""
    return {name: value for name, value in keyed.items() if name not in unread}


def cache_key_dump(model: BaseModel) -> dict:
    """`model_dump(mode="json")` without the runtime fields, at any depth."""
    out = {}
    for name, info in type(model).model_fields.items():
        if info.json_schema_extra == RUNTIME:
            continue
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = cache_key_dump(value)
        elif isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
            out[name] = [cache_key_dump(v) for v in value]
        else:
            out[name] = model.model_dump(mode="json", include={name})[name]
    view = getattr(model, "cache_key_view", None)  # a section that keys two spellings of one computation alike
    return view(out) if view else out


def _numeric(annotation) -> bool:
    """An int or float field, optional or not (not a bool field, which takes booleans)."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [arg for arg in get_args(annotation) if arg is not type(None)]
        return bool(kinds) and all(_numeric(arg) for arg in kinds)
    return annotation in (int, float)


def yes_no_for_a_number(annotation, value) -> bool:
    """A boolean given for an int or float field, which pydantic would read as 1 or 0."""
    return isinstance(value, bool) and _numeric(annotation)


def float32_problem(value: float) -> str | None:
    """Why a finite number cannot be used where training computes in float32, or None: beyond its range it is
    infinite there (a KL weight of 1e39 turned every loss into NaN), and a nonzero value below its smallest is 0
    (a learning rate of 1e-300 trains nothing)."""
    try:
        as_float32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # where struct refuses instead of rounding to infinity
        as_float32 = math.inf
    if math.isinf(as_float32):
        return f"is {value:g}, beyond float32's range (+-3.4e38), in which it is computed: give a smaller value"
    if value != 0 and as_float32 == 0:
        return f"is {value:g}, which float32 (in which it is computed) rounds to 0: give a larger value"
    return None


def encodable(text: str) -> bool:
    """False for text holding a lone surrogate (JSON's \\ud800-style escapes can spell one, as can YAML's, or a byte
    that is not UTF-8 in a shell argument): no tokenizer, shard or config dump can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_problem(value: str) -> str | None:
    """Why a string is not text, or None: a lone surrogate passes as a str until something encodes it."""
    if encodable(value):
        return None
    return ("holds a lone surrogate (an unpaired \\ud800-\\udfff escape, or a byte that is not UTF-8 text), which "
            "is not valid Unicode: fix or remove it")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _computable(cls, value):
        """Every number usable in float32 and every string valid Unicode, whatever the field (and in lists)."""
        for item in value if isinstance(value, list) else [value]:
            problem = (float32_problem(item) if isinstance(item, float) else
                       text_problem(item) if isinstance(item, str) else None)
            if problem:
                raise ValueError(problem)
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value, info: ValidationInfo):
        # pydantic reads true as 1 in a number field: `seed: yes` or `epochs: true` would run silently as 1.
        if yes_no_for_a_number(cls.model_fields[info.field_name].annotation, value):
            raise ValueError(f"is {str(value).lower()}, a yes/no value, where a number is expected: give a number")
        return value


def service_url(url: str, example: str) -> str:
    """An OpenAI-compatible API root: http(s), without credentials (empty: none given)."""
    if url and not url.startswith(("http://", "https://")):
        raise ValueError(f"must be an http:// or https:// URL, e.g. {example}")
    return no_credentials(url)


def no_credentials(url: str | None, paths: bool = False) -> str | None:
    """URLs never carry a user or password, nor (http and https ones) a query or fragment, where tokens and
    signatures go: they would be echoed in logs, saved configs and compiled pipelines, and a query would swallow the
    paths joined after it. `paths`: a file or storage location, whose names and S3 keys may hold '?' and '#'.
    (A database tracking URI's query, ?sslmode=require, holds no credentials.) Nor spaces at either end."""
    refuse_edge_space(url)
    if url and "://" in url and (urlsplit(url).username or urlsplit(url).password):
        raise ValueError("must not contain a user name or password: give credentials through the environment")
    if url and url.startswith(("http://", "https://")) and not paths and ("?" in url or "#" in url):
        raise ValueError("must not carry a query (?...) or fragment (#...): give the plain URL, and credentials "
                         "through the environment")
    return url


