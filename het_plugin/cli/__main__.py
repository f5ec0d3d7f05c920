"""``python -m het_plugin.cli`` (e.g. under torchrun without --no-python)."""
import sys

from . import main

sys.exit(main())
