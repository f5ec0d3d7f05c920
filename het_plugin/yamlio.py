"""Reading YAML/JSON inputs and turning schema violations into one clear ConfigError."""
from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from .errors import ConfigError

T = TypeVar("T", bound=pydantic.BaseModel)


def read_data(path: str | Path) -> Any:
    """Parse a YAML file with ``yaml.safe_load`` (a .json file with ``json``); errors carry the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("file not found", source=str(path),
                          fix="pass an existing file (see examples/clusters and examples/models)")
    text = path.read_text()
    if path.suffix == ".json":
        # Not through YAML: YAML 1.1 reads JSON's 1e-05 as a string, which would change a plan's hash.
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                              source=str(path), fix="correct the syntax at that line") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and cmark and (not mark or cmark.line != mark.line):
            # The parser notices an unclosed bracket or quote later than where it starts: say both.
            problem += f" ({context} that starts at line {cmark.line + 1}, column {cmark.column + 1})"
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


def validate(cls: type[T], data: Any, source: str, text: str | None = None) -> T:
    """Validate ``data`` against a pydantic model; the most useful error becomes a ConfigError.

    ``text`` (the file's YAML) lets the message say on which line the offending field is.
    """
    if data is None:
        raise ConfigError("the file is empty", source=source,
                          fix="write the fields described in docs/user-guide.md (examples: examples/clusters, "
                              "examples/models)")
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _config_error(cls, exc, source, text) from None


def load_validated(cls: type[T], path: str | Path) -> T:
    """Read a YAML/JSON file and validate it; errors name the file, the field path, its line and the fix."""
    data = read_data(path)
    return validate(cls, data, str(path), Path(path).read_text())


def _config_error(cls: type[pydantic.BaseModel], exc: pydantic.ValidationError, source: str,
                  text: str | None) -> ConfigError:
    errors = exc.errors(include_url=False)
    # A misspelled field shows up twice: 'missing' for the right name and 'extra_forbidden' for the
    # typo. The typo is the user's actual mistake, so report it first.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    # Drop pydantic's union/tag names from the path: they are not fields the user wrote.
    tags = _model_names(cls) | {"str", "int", "float", "bool"}
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-")
                                                                       or p in tags)))
    msg = re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    fix = _FIXES.get(err["type"])
    ctx = err.get("ctx") or {}
    if err["type"] == "extra_forbidden":
        allowed = cls_fields(cls, loc)
        msg = f"unknown field {loc[-1]!r}"
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        fix = (f"did you mean {close[0]!r}? " if close else "remove it or check its spelling; ") + \
            f"allowed fields here: {', '.join(allowed)}"
    elif err["type"] == "missing":
        msg = f"required field {loc[-1]!r} is missing"
    elif "input" in err and err["type"] not in ("value_error", "assertion_error") and _short(err["input"]):
        msg = f"{msg} (got {err['input']!r})"
    if err["type"] == "literal_error" and "expected" in ctx:
        fix = f"use one of {ctx['expected']}"
    if " | fix: " in msg:
        msg, fix = msg.split(" | fix: ", 1)
    if " | field: " in msg:   # a cross-field check names the exact field it is about
        msg, rel = msg.split(" | field: ", 1)
        loc = loc + _parse_path(rel)
    path = field_path(loc)
    where = loc if err["type"] != "missing" else loc[:-1]   # a missing key: the mapping that lacks it
    line = _line_of(text, where) if text and where else None
    if line:
        path += f" (line {line})"
    return ConfigError(msg, source=source, field=path, fix=fix)


def _model_names(cls: type, seen: set | None = None) -> set[str]:
    """Class names of every pydantic model reachable from ``cls`` (pydantic puts them in union error paths)."""
    seen = set() if seen is None else seen
    if cls.__name__ in seen:
        return seen
    seen.add(cls.__name__)
    for info in cls.model_fields.values():
        stack = [info.annotation]
        while stack:
            ann = stack.pop()
            stack.extend(getattr(ann, "__args__", ()))
            if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
                _model_names(ann, seen)
    return seen


def with_line(exc: ConfigError, text: str) -> ConfigError:
    """The same error with the line of its field in ``text`` added (for checks made after validation)."""
    if not exc.field or "(line" in exc.field or "*" in exc.field:
        return exc
    line = _line_of(text, _parse_path(exc.field))
    if not line:
        return exc
    return ConfigError(exc.problem, source=exc.source, field=f"{exc.field} (line {line})", fix=exc.fix)


def _short(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 60


def _parse_path(text: str) -> tuple:
    """'links[0].between' -> ('links', 0, 'between')."""
    out: list = []
    for name, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", text):
        out.append(int(index) if index else name)
    return tuple(out)


def _line_of(text: str, loc: tuple) -> int | None:
    """1-based line of the YAML node at ``loc`` (a key's line for mapping entries), or None."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            hit = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            if hit is None:
                return None
            line, node = hit[0].start_mark.line + 1, hit[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


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
