"""The core's one writer: the files a caller names (a plan, a measured profile, the CLI's outputs), written
atomically. The pure core writes nothing else: no environment, no store, no file it was not asked to write
(tests/core/test_purity.py checks that file writes in core and views happen only here). Writing a plan or a
profile stays a method of the core's values (``Plan.save``, ``MeasuredProfile.save``) and the format rule
(JSON or YAML by suffix, the YAML size limit of the reader) stays beside the reader it must match."""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .inputs.yamlio import MAX_YAML_BYTES, _mib


def dump_data(data: Any, path: str | Path) -> None:
    """Write JSON when the path ends in .json, YAML otherwise; atomically (see :func:`write_atomic`).

    A YAML file over :data:`MAX_YAML_BYTES` is refused: het_plugin could not read it back."""
    path = Path(path)
    if path.suffix == ".json":
        text = json.dumps(data, indent=1) + "\n"
    else:
        text = yaml.safe_dump(data, sort_keys=False)
        if len(text.encode()) > MAX_YAML_BYTES:
            raise ConfigError(f"as YAML this is {_mib(len(text.encode()))}, over the {_mib(MAX_YAML_BYTES)} het_plugin "
                              "reads from a YAML file", source=str(path), field="-o/--output",
                              fix=f"write it as JSON: {path.with_suffix('.json')}")
    write_atomic(path, text)


def write_atomic(path: str | Path, text: str | bytes, what: str = "output") -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part: a private
    temporary file (``mkstemp``, mode 0600 until complete) in the same folder, then ``os.replace``. A
    symlink is followed (its target is replaced). Errors become a ConfigError naming the path."""
    path = Path(os.path.realpath(path))
    data = text.encode() if isinstance(text, str) else text
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _write_error(exc, path, what) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        _unlink_quietly(tmp)
        raise _write_error(exc, path, what) from None
    except BaseException:
        _unlink_quietly(tmp)
        raise


def check_writable(path: str | Path, field: str, what: str = "output") -> None:
    """Fail now, not after minutes of work, when ``path`` cannot be written: its folder is missing or not
    writable (probed by creating and removing a private temporary file there), or it is a directory."""
    real = Path(os.path.realpath(path))
    if real.is_dir():
        raise ConfigError(f"{path} is a directory", source=str(path), field=field,
                          fix=f"give a file name, e.g. {Path(path) / ('plan.json' if what == 'plan' else 'out')}")
    if not real.parent.is_dir():
        raise ConfigError(f"the folder {str(real.parent)!r} does not exist", source=str(path), field=field,
                          fix="create the folder first, or write somewhere that exists")
    if real.exists() and not os.access(real, os.W_OK):
        raise ConfigError("the file exists and is not writable", source=str(path), field=field,
                          fix="make it writable, or choose another name")
    try:
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".probe")
    except OSError as exc:
        raise _write_error(exc, real, what, field) from None
    os.close(fd)
    _unlink_quietly(tmp)


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when ``a`` and ``b`` name one file (hard links, symlinks, ./ and ../ included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _write_error(exc: OSError, path: Path, what: str, field: str | None = None) -> ConfigError:
    return ConfigError(f"cannot write the {what}: {exc.strerror or exc}", source=str(path), field=field,
                       fix="choose a folder you can write to (and that has space), or fix its permissions")


def _unlink_quietly(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
