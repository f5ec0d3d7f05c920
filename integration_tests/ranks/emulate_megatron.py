"""Rank script: the tiny GPT trained through het_plugin.megatron inside the emulator; reports losses, groups
and how many bytes this rank sent on each emulated interface (fab0: cluster fabric, eth0: Ethernet)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from integration_tests.support.launch import arm_watchdog, report  # noqa: E402


def tx() -> dict:
    out = {}
    for ifname in ("eth0", "fab0"):
        p = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
        out[ifname] = int(p.read_text()) if p.exists() else 0
    return out


def main() -> None:
    arm_watchdog()
    import json
    cluster, pp, steps, tiny = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    from integration_tests.support.megatron_tiny import TinyGPT, shutdown, train
    before = tx()
    result = train(TinyGPT(**tiny), tp=1, pp=pp, steps=steps, cluster=cluster)
    after = tx()
    shutdown()
    report(dict(result.to_dict(), tx={k: after[k] - before[k] for k in after}))


if __name__ == "__main__":
    main()
