"""Reading YAML/JSON inputs and turning schema violations into one clear ConfigError."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from .errors import ConfigError

T = TypeVar("T", bound=pydantic.BaseModel)


def read_data(path: str | Path) -> Any:
    """Parse a YAML (or JSON, which is YAML) file with ``yaml.safe_load``; errors carry the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file not found", source=str(path),
                          fix="pass an existing file (see examples/clusters and examples/models)")
    text = path.read_text()
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML at {line}{problem}", source=str(path),
                          fix="correct the syntax at that line (indentation, a missing ':' or quote)") from None


def field_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def validate(cls: type[T], data: Any, source: str) -> T:
    """Validate ``data`` against a pydantic model; the first error becomes a ConfigError."""
    if data is None:
        raise ConfigError("the file is empty", source=source, fix=f"describe a {cls.__name__}")
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        # Drop pydantic's union/tag names from the path: they are not fields the user wrote.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        msg = err["msg"].removeprefix("Value error, ")
        fix = _FIXES.get(err["type"])
        ctx = err.get("ctx") or {}
        if err["type"] == "extra_forbidden":
            fix = f"remove it or check its spelling; allowed fields: {', '.join(cls_fields(cls, loc))}"
        if err["type"] == "literal_error" and "expected" in ctx:
            fix = f"use one of {ctx['expected']}"
        if " | fix: " in msg:
            msg, fix = msg.split(" | fix: ", 1)
        raise ConfigError(msg, source=source, field=field_path(loc), fix=fix) from None


def cls_fields(cls: type[pydantic.BaseModel], loc: tuple) -> list[str]:
    """Field names of the model that holds the location, for 'did you mean' style fixes."""
    model: Any = cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        info = getattr(model, "model_fields", {}).get(part)
        if info is None:
            break
        ann = info.annotation
        for cand in getattr(ann, "__args__", ()) + (ann,):
            inner = getattr(cand, "__args__", (cand,))
            found = [c for c in inner if isinstance(c, type) and issubclass(c, pydantic.BaseModel)]
            if found:
                model = found[0]
                break
    return sorted(getattr(model, "model_fields", {}))


_FIXES = {
    "missing": "add this field",
    "int_parsing": "use a whole number",
    "int_type": "use a whole number",
    "float_parsing": "use a number",
    "greater_than": "use a positive value",
    "greater_than_equal": "use a larger value",
    "list_type": "use a YAML list (lines starting with '- ')",
    "model_type": "use a mapping (key: value lines)",
    "dict_type": "use a mapping (key: value lines)",
}


def dump_data(data: Any, path: str | Path) -> None:
    """Write JSON when the path ends in .json, YAML otherwise."""
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=1) + "\n")
    else:
        path.write_text(yaml.safe_dump(data, sort_keys=False))
