"""Reading YAML/JSON inputs and turning schema violations into one clear ConfigError."""
from __future__ import annotations

import difflib
import json
import re
import stat
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from ..errors import ConfigError

T = TypeVar("T", bound=pydantic.BaseModel)


# ---- limits on what a file may be (docs/user-guide.md, "Limits") -----------------------------------------
MAX_YAML_BYTES = 4 * 2 ** 20     # pure-Python YAML reads ~0.3 MB/s: a bigger file would take more than 15 s
MAX_JSON_BYTES = 64 * 2 ** 20    # a plan for 131,072 ranks is ~28 MB of JSON (read in well under a second)
MAX_DEPTH = 64                   # mappings/lists inside each other (the schemas need fewer than 10)
MAX_EXPANDED = 1_000_000         # values a YAML file's aliases (*name) may expand to


def _limit_for(path: Path) -> int:
    return MAX_JSON_BYTES if path.suffix == ".json" else MAX_YAML_BYTES


def read_text(path: str | Path, what: str = "file") -> str:
    """The text of an input file, or one ConfigError naming it: missing, a directory or other non-file,
    unreadable, too big (see :data:`MAX_YAML_BYTES` / :data:`MAX_JSON_BYTES`), not UTF-8."""
    path = Path(path)
    src = str(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} not found", source=src,
                          fix="pass an existing file (see examples/clusters and examples/models)") from None
    except PermissionError:
        raise ConfigError(f"cannot read the {what}: permission denied (on the file or a folder above it)",
                          source=src, fix="make it readable (chmod a+r, and a+x on its folders) or run as a user "
                                          "who can read it") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what}: {exc.strerror or exc}", source=src,
                          fix="pass a file that exists and can be read") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"this is a directory, not a {what}", source=src,
                          fix="pass one of the files inside it, not the folder")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"not a regular file (a pipe, device or socket); the {what} is read more than once",
                          source=src, fix="save it to a file first and pass that file")
    limit = _limit_for(path)
    if st.st_size > limit:
        raise ConfigError(f"the {what} is {_mib(st.st_size)}, over the {_mib(limit)} limit for "
                          f"{'JSON' if limit == MAX_JSON_BYTES else 'YAML'} files", source=src,
                          fix="pass the right file; big plans are read fastest as JSON (het-plugin plan -o plan.json)"
                          if limit == MAX_YAML_BYTES else "pass the right file (a plan for the largest cluster "
                                                          "het_plugin plans is well under this)")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except PermissionError:
        raise ConfigError(f"cannot read the {what}: permission denied", source=src,
                          fix="make it readable (chmod a+r) or run as a user who can read it") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the {what}: {exc.strerror or exc}", source=src,
                          fix="check the file and the disk it is on, or pass another file") from None
    if len(raw) > limit:        # it grew since stat
        raise ConfigError(f"the {what} is over the {_mib(limit)} limit", source=src, fix="pass the right file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column {col}", source=src,
                          fix="save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > NEW), or pass the "
                              "right file") from None


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def read_data(path: str | Path, text: str | None = None) -> Any:
    """Parse a YAML file with a safe loader (a .json file with ``json``); errors carry the line.

    ``text``: the file's text when the caller has read it already (:func:`read_text`)."""
    path = Path(path)
    if text is None:
        text = read_text(path)
    if path.suffix == ".json":
        return parse_json(text, str(path))
    return parse_yaml(text, str(path))


def parse_json(text: str, source: str) -> Any:
    # Not through YAML: YAML 1.1 reads JSON's 1e-05 as a string, which would change a plan's hash.
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}",
                          source=source, fix="correct the syntax at that line") from None
    except RecursionError:
        raise ConfigError("brackets nested too deeply", source=source,
                          fix=f"het_plugin's files nest at most {MAX_DEPTH} levels; pass the right file") from None
    except ValueError as exc:      # an integer of more than 4300 digits
        raise ConfigError(f"malformed JSON: {exc}".split(";")[0], source=source,
                          fix="write numbers of a sensible size") from None


class _TooDeep(yaml.MarkedYAMLError):
    pass


class SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses nesting deeper than :data:`MAX_DEPTH` before recursing into it (the
    composer is recursive: 50,000 brackets were a RecursionError), and turns a value the constructor
    cannot convert (an integer of 5,000 digits, a date such as 2024-13-45) into an error with its line."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self.saw_alias = False

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.saw_alias = True
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _TooDeep(None, None, f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:
            value = node.value if isinstance(node.value, str) else ""
            shown = repr(value) if len(value) <= 40 else repr(value[:20]) + f"... ({len(value)} characters)"
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read the value {shown}: {str(exc).split(';')[0]}", node.start_mark) from None


def compose(text: str) -> Any:
    """The YAML node tree of ``text`` (depth-limited; raises yaml.YAMLError)."""
    loader = SafeLoader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str) -> Any:
    """``text`` as YAML data: safe tags only, depth-limited, duplicate keys and alias bombs refused."""
    try:
        loader = SafeLoader(text)       # the reader checks the characters here already
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, source) from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, source, loader.saw_alias)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, text, source) from None
    finally:
        loader.dispose()


def _yaml_error(exc: yaml.YAMLError, text: str, source: str) -> ConfigError:
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        return ConfigError(f"malformed YAML at line {line}, column {col}: character #x{exc.character:04x} is not "
                           "allowed in YAML", source=source, fix="remove that character (control characters and "
                                                                  "NUL bytes cannot appear in YAML)")
    mark = getattr(exc, "problem_mark", None)
    line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if isinstance(exc, _TooDeep):
        return ConfigError(f"YAML at {line}{problem}", source=source,
                           fix="het_plugin's files need fewer than 10 levels; pass the right file")
    context, cmark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and cmark and (not mark or cmark.line != mark.line):
        # The parser notices an unclosed bracket or quote later than where it starts: say both.
        problem += f" ({context} that starts at line {cmark.line + 1}, column {cmark.column + 1})"
    return ConfigError(f"malformed YAML at {line}{problem}", source=source,
                       fix="correct the syntax at that line (indentation, a missing ':' or quote)")


def _check_nodes(root: Any, source: str, aliases: bool) -> None:
    """Duplicate keys in a mapping (YAML would keep the last one silently; a later error would then point at
    the wrong line), and, when the file uses aliases, how many values they expand to (a "billion laughs"
    file is a few lines) and alias cycles. Linear in the number of nodes."""
    seen: set[int] = set()
    stack = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: dict = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    first = keys.setdefault((k.tag, k.value), k)
                    if first is not k:
                        where = field_path(path + (k.value,))
                        raise ConfigError(f"duplicate key {k.value!r} (first at line {first.start_mark.line + 1}); "
                                          "YAML would keep only the last value", source=source,
                                          field=f"{where} (line {k.start_mark.line + 1})",
                                          fix=f"keep one {k.value!r} in this mapping")
                stack.append((v, path + (k.value if isinstance(k, yaml.ScalarNode) else "?",)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, path + (i,)) for i, v in enumerate(node.value))
    if aliases:
        _check_expansion(root, source)


def _check_expansion(root: Any, source: str) -> None:
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(c)] for c in kids)
            if size[key] > MAX_EXPANDED:
                raise ConfigError(f"the aliases (*name) at line {node.start_mark.line + 1} expand to more than "
                                  f"{MAX_EXPANDED:,} values", source=source,
                                  fix="write the values out, or use fewer nested aliases")
            continue
        if key in size:
            continue
        if key in on_path:
            raise ConfigError(f"the alias (*name) at line {node.start_mark.line + 1} refers to a value that "
                              "contains it (a cycle)", source=source, fix="remove the alias from inside its anchor")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)


def _children(node: Any) -> list:
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


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
    text = read_text(path)
    return validate(cls, read_data(path, text), str(path), text)


def _config_error(cls: type[pydantic.BaseModel], exc: pydantic.ValidationError, source: str,
                  text: str | None) -> ConfigError:
    errors = exc.errors(include_url=False)
    # A misspelled field shows up twice: 'missing' for the right name and 'extra_forbidden' for the
    # typo. The typo is the user's actual mistake, so report it first.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    tags = _model_names(cls) | {"str", "int", "float", "bool"}
    # A union (an accelerator name, or a mapping describing one) fails once per branch; the branch the user
    # meant is the one that got further: drop a branch error when another went deeper under the same field.
    deeper = [e for e in errors if not (isinstance(e["loc"][-1:] and e["loc"][-1], str) and e["loc"][-1] in tags
                                        and any(len(o["loc"]) > len(e["loc"]) and o["loc"][:len(e["loc"]) - 1]
                                                == e["loc"][:-1] for o in errors))]
    err = (deeper or errors)[0]
    # Drop pydantic's union/tag names from the path: they are not fields the user wrote.
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
    """1-based line of the YAML node at ``loc`` (a key's line for mapping entries), or None. A top-level key
    written once at the start of a line is found without composing the document (seconds for a large file)."""
    if len(loc) == 1 and isinstance(loc[0], str):
        hits = [m for m in re.finditer(rf"^(?:{re.escape(loc[0])}|\"{re.escape(loc[0])}\"|'{re.escape(loc[0])}')[ \t]*:",
                                       text, re.MULTILINE)]
        if len(hits) == 1:
            return text.count("\n", 0, hits[0].start()) + 1
    try:
        node = compose(text)
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
    "int_from_float": "use a whole number",
    "float_parsing": "use a number",
    "finite_number": "use a finite number (not .inf or .nan)",
    "less_than_equal": "use a smaller value (docs/user-guide.md lists the limits)",
    "greater_than": "use a positive value",
    "greater_than_equal": "use a larger value",
    "list_type": "use a YAML list (lines starting with '- ')",
    "model_type": "use a mapping (key: value lines)",
    "dict_type": "use a mapping (key: value lines)",
}
