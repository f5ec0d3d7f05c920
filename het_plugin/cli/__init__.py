"""The ``het-plugin`` command. Each subcommand lives in its own module here and registers itself."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..core.errors import HetPluginError

# Modules under het_plugin.cli, each with ``register(subparsers)``; add a name when adding a subcommand.
SUBCOMMANDS = ["plan", "emulate", "discover", "wrap-config", "patch", "check", "profile"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="het-plugin", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name.replace('-', '_')}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except HetPluginError as exc:
        print(f"het-plugin {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:            # `het-plugin plan | head`: the reader left; not an error
        sys.stderr = open(os.devnull, "w")
        return 0
    except OSError as exc:             # a file the checks before could not foresee (disk full, gone meanwhile)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"het-plugin {args.command}: error: {where}{exc.strerror or exc}\n  fix: check the path, its "
              "permissions and the free space, then run again", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
