"""Rank script: ``het-plugin profile ARGS...`` on this rank (what ``torchrun --no-python het-plugin profile``
runs); exits with the command's code. A first argument ``--megatron-cpu-shims`` installs the test-only CPU
shims for Megatron-Core first (integration_tests/support/megatron_cpu.py), so ``--layers megatron`` runs here."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from integration_tests.support.launch import arm_watchdog  # noqa: E402

if __name__ == "__main__":
    arm_watchdog()
    args = sys.argv[1:]
    if args[:1] == ["--megatron-cpu-shims"]:
        from integration_tests.support.megatron_cpu import enable_cpu_shims, enable_moe_cpu_shims
        enable_cpu_shims()
        enable_moe_cpu_shims()
        args = args[1:]
    from het_plugin.cli import main
    sys.exit(main(["profile", *args]))
