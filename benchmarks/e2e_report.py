"""The end-to-end benchmark's outputs: a Markdown results section and a PNG chart."""
from __future__ import annotations

import time
from pathlib import Path

from e2e_drift import run_verdict

START, END = "<!-- RESULTS START (written by benchmarks/bench_e2e.py) -->", "<!-- RESULTS END -->"
UNRELIABLE_START = "<!-- UNRELIABLE RUN START (written by benchmarks/bench_e2e.py; never a headline) -->"
UNRELIABLE_END = "<!-- UNRELIABLE RUN END -->"
ORDER = ["1-all-fast", "2-all-eth", "3-mixed-today", "4p-placement", "4t-place+transport", "4-het_plugin"]


def _rows(out: dict) -> list[dict]:
    return sorted(out["ratios"], key=lambda r: r["ratio"])


def verdict_of(out: dict) -> dict:
    """The run's drift verdict as recorded, or (a run recorded before there was one) computed from its numbers."""
    return out.get("reliability") or run_verdict(out).to_dict()


def scale_sentence(s: dict) -> str:
    """How the emulated Ethernet rate was chosen, for runs of every version of the benchmark."""
    head = f"**Scale**: real 25 GbE -> emulated {s['eth_mbit']:.1f} Mbit/s, i.e. 1/{s['scale']:.0f}"
    if s.get("mode") == "proportions":
        return head + (" (set after the start-of-run calibration so that dp_eth and pp_eth are within "
                       f"{s['tolerance']:.0%} of the real job's, and held for the run)")
    if "matched_eth_mbit" in s:
        return head + (f" (fixed with `--eth-mbit`; the proportion-matched rate with this run's compute: "
                       f"{s['matched_eth_mbit']:.1f} Mbit/s)")
    if s.get("fixed"):
        return head + (f" (fixed; the real job's gradient proportion dp_eth would need {s['derived_eth_mbit']:.1f} "
                       "Mbit/s with this run's compute)")
    return head + (" (derived from this run's compute: the real job's dp_eth)" if "derived_eth_mbit" in s else "")


def verdict_sentence(v: dict) -> str:
    cal = f"{v['calibration_spread']:.0%}" if v.get("calibration_spread") is not None else "n/a (one calibration run)"
    what = (f"drift margin {v['margin']:.0%} on the spread (max-min over median) of the calibration run's times "
            f"(here {cal}) and of each configuration's rounds ("
            + (f"widest here: {v['worst_config']}, {v['worst_config_spread']:.0%}" if v.get("worst_config")
               else "one round each: no spread to see") + "); benchmarks/e2e_drift.py")
    if v["reliable"]:
        return f"**Reliable** ({what})."
    shown = v["reasons"][:4]
    more = len(v["reasons"]) - len(shown)
    return (f"**UNRELIABLE: the machine moved during this run; not a headline** ({what}): " + "; ".join(shown)
            + (f"; and {more} more over the margin (all in the JSON's `reliability`)" if more else "") + ".")


def results_markdown(out: dict, chart: Path | None, markers: tuple[str, str] = (START, END)) -> str:
    s = out["scale"]
    rounds_scale = out.get("scale_rounds")
    lines = [markers[0], "",
             f"Run {out.get('started_utc') or time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{out['wall_s'] / 60:.1f} min wall; "
             f"{out['rounds']} round(s) x {out['steps']} measured steps after {out['warmup']} warm-up, "
             "configurations interleaved within each round. Latency is not emulated (no netem): bandwidth only.",
             "",
             f"Machine: {out.get('cores')} cores; other programs' runnable tasks at the start: "
             f"{out.get('others_runnable_start', 'not recorded')}; 1-minute load average {out['load_average'][0]:.1f} "
             f"at the start (a decaying average: it remembers earlier work) and {out['load_average'][1]:.1f} at the "
             "end (that one counts the benchmark's own ranks)"
             + (" -- **other programs were running: these numbers are noise-dominated; rerun on an idle machine**"
                if (out.get("others_runnable_start") or 0) > (out.get("cores") or 1) else "")
             + (" (a `--quick` smoke run)" if out.get("quick") else "") + ".",
             "",
             verdict_sentence(verdict_of(out)),
             "",
             *([("Rounds repeated (`--repeat-drifted`): " + "; ".join(
                 f"dropped the round then #{r['dropped_round_index'] + 1} of those kept ("
                 + ", ".join(r["reasons"]) + ")" for r in out["repeated_rounds"]) + "; the verdict above is on "
                 "the rounds kept."), ""] if out.get("repeated_rounds") else []),
             scale_sentence(s) + ". "
             f"Measured compute: {sum(out['compute']['layer']) * 1e3:.1f} ms per layer fwd+bwd "
             f"(micro-batch {out['compute']['micro_batch_size']}, all ranks computing at once), framework overhead "
             f"{out['compute'].get('overhead_per_micro_batch', 0) * 1e3:.1f} ms per micro-batch and "
             f"{out['compute'].get('overhead_per_step', 0) * 1e3:.0f} ms per step"
             + (f"; the calibration run ({out['compute']['calibration_step_s'] * 1e3:.0f} ms per step on the "
                f"unshaped reference network) adds "
                f"{out['compute']['pipeline_overhead_per_micro_batch'] * 1e3:.1f} ms per micro-batch and stage"
                if "calibration_step_s" in out["compute"] else "; no calibration run")
             + (f". The calibration run also ran first in every round ("
                + ", ".join(f"{t * 1e3:.0f}" for t in out["compute"]["rounds_calibration_step_s"])
                + f" ms): the predictions below are fitted to their median "
                f"({out['compute']['rounds_pipeline_overhead_per_micro_batch'] * 1e3:+.1f} ms per micro-batch and stage); "
                "'start-of-run fit' is the prediction from the first calibration alone"
                if "rounds_calibration_step_s" in out["compute"] else "") + ".",
             "",
             ]
    if rounds_scale:
        lines += ["| proportion | real job | this benchmark (start-of-run calibration) | over the rounds (their "
                  "calibration's median) |", "|---|---|---|---|"]
        r = rounds_scale["tiny"]
        lines += [f"| gradient all-reduce on Ethernet / compute (dp_eth) | {s['real']['dp_eth']:.2f} | "
                  f"{s['tiny']['dp_eth']:.2f} | {r['dp_eth']:.2f} |",
                  f"| pipeline traffic on Ethernet / compute (pp_eth) | {s['real']['pp_eth']:.3f} | "
                  f"{s['tiny']['pp_eth']:.3f} | {r['pp_eth']:.3f} |",
                  f"| activation : gradient bytes (act_grad) | {s['real']['act_grad']:.3f} | "
                  f"{s['tiny']['act_grad']:.3f} | {r['act_grad']:.3f} |", ""]
    else:
        lines += [
             "| proportion | real job | this benchmark |", "|---|---|---|",
             f"| gradient all-reduce on Ethernet / compute (dp_eth) | {s['real']['dp_eth']:.2f} | {s['tiny']['dp_eth']:.2f} |",
             f"| pipeline traffic on Ethernet / compute (pp_eth) | {s['real']['pp_eth']:.3f} | {s['tiny']['pp_eth']:.3f} |",
             f"| activation : gradient bytes (act_grad) | {s['real']['act_grad']:.3f} | {s['tiny']['act_grad']:.3f} |",
             ""]
    lines += ["Each ratio: the median over rounds of the per-round ratio, [lowest-highest round] beside it.", "",
              "| fast:slow | Ethernet / fabric (Mbit/s) | 4/3 (goal <= 0.60) | 4/1 (goal <= 1.15) | 4/2 (goal <= 0.55) "
              "| 4p/3 | 4t/3 |",
              "|---|---|---|---|---|---|---|"]
    for row in _rows(out):
        r, spread = row["ratios"], row.get("ratio_spread", {})
        cell = lambda k: (f"{r[k]:.2f}" + (f" [{spread[k][0]:.2f}-{spread[k][1]:.2f}]" if k in spread else "")  # noqa: E731
                          if k in r else "-")
        lines.append(f"| {row['ratio']:g}:1 | {s['eth_mbit']:.0f} / {row['ratio'] * s['eth_mbit']:.0f} "
                     f"| {cell('4/3')} | {cell('4/1')} | {cell('4/2')} | {cell('4p/3')} "
                     f"| {cell('4t/3')} |")
    lines.append("")
    for row in _rows(out):
        plan = row["plan"]
        lines += [f"**{row['ratio']:g}:1** (links measured, largest message and latency: " + ", ".join(
            f"{k} {v['bandwidth'][-1][1] * 1e3:.0f} Mbit/s / {v['latency_us']:.0f} us"
            for k, v in row["links"].items()) + "); "
            f"plan: ranks {plan['rank_of_logical']}, layers {plan['layers_per_stage']}, "
            f"micro-batch {plan['micro_batch_size']} x {plan['num_micro_batches']}, "
            f"overlap {plan['overlap_grad_reduce']}, pp transport {plan['transports'].get('pp')}, "
            f"dp transport {plan['transports'].get('dp')}", "",
            "| configuration | measured step (median) | per round | predicted | error | start-of-run fit | compute share |",
            "|---|---|---|---|---|---|---|"]
        by = {c["name"]: c for c in row["configs"]}
        for name in [n for n in ORDER if n in by]:
            c = by[name]
            lines.append(f"| {name} | {c['median_s'] * 1e3:.0f} ms | "
                         + " / ".join(f"{x * 1e3:.0f}" for x in c["rounds_s"])
                         + f" | {c['predicted_s'] * 1e3:.0f} ms | {c['error'] * 100:+.0f}% | "
                         + (f"{c['predicted_start_s'] * 1e3:.0f} ms ({(c['predicted_start_s'] / c['median_s'] - 1) * 100:+.0f}%)"
                            if c.get("predicted_start_s") else "-")
                         + f" | {c['compute_share'] * 100:.0f}% |")
        lines.append("")
    if chart is not None:
        lines += [f"![step times and ratios](img/{chart.name})", ""]
    lines.append(markers[1])
    return "\n".join(lines)


def _replace_section(path: Path, section: str, start: str, end: str, after: str | None = None) -> None:
    """Put ``section`` between ``start`` and ``end`` in the file (after the marker ``after``, or at the end,
    the first time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
    elif after and after in text:
        i = text.index(after) + len(after)
        text = text[:i] + "\n\n" + section + text[i:]
    else:
        text = (text + "\n\n" if text else "# End-to-end benchmark results\n\n") + section + "\n"
    path.write_text(text)


def write_unreliable(out: dict, path: Path) -> str:
    """A drifted run's section: its numbers, marked, below the recorded run's (which it does not replace)."""
    body = results_markdown(out, None, (UNRELIABLE_START, UNRELIABLE_END))
    title = "### Latest unreliable run (kept for the record; not a headline, not in README)"
    section = body.replace(UNRELIABLE_START, UNRELIABLE_START + "\n\n" + title, 1)
    _replace_section(path, section, UNRELIABLE_START, UNRELIABLE_END, after=END)
    return section


def write_markdown(out: dict, path: Path, chart: Path | None) -> str:
    section = results_markdown(out, chart)
    _replace_section(path, section, START, END)
    return section


def write_chart(out: dict, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = _rows(out)
    xs = [r["ratio"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ORDER:
        meas = [next((c["median_s"] for c in r["configs"] if c["name"] == name), None) for r in rows]
        if all(m is None for m in meas):
            continue
        pred = [next((c["predicted_s"] for c in r["configs"] if c["name"] == name), None) for r in rows]
        line, = a.plot(xs, [m * 1e3 for m in meas], marker="o", label=name)
        a.plot(xs, [p * 1e3 for p in pred], linestyle=":", color=line.get_color())
    a.set_xscale("log")
    a.minorticks_off()
    a.set_xticks(xs, [f"{x:g}:1" for x in xs])
    a.set_xlabel("fabric : Ethernet bandwidth")
    a.set_ylabel("step time (ms); dotted: predicted")
    a.set_title("median step time")
    a.legend(fontsize=7)
    for key, goal in (("4/3", 0.60), ("4/1", 1.15), ("4/2", 0.55)):
        vals = [r["ratios"].get(key) for r in rows]
        line, = b.plot(xs, vals, marker="o", label=f"{key} (goal at 10:1 <= {goal})")
        b.axhline(goal, color=line.get_color(), linestyle=":", linewidth=0.8)
    b.set_xscale("log")
    b.minorticks_off()
    b.set_xticks(xs, [f"{x:g}:1" for x in xs])
    b.set_xlabel("fabric : Ethernet bandwidth")
    b.set_title("step-time ratios (lower is better for het_plugin)")
    b.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def side_by_side(out: dict) -> str:
    """A plain table for a run that includes the DeepSpeed configurations (printed, not written to docs)."""
    lines = [f"Run {out['started_utc']}, {out['wall_s'] / 60:.1f} min wall; framework {out['framework']}; "
             f"{out['rounds']} round(s) x {out['steps']} measured steps after {out['warmup']} warm-up; "
             f"Ethernet {out['scale']['eth_mbit']:.1f} Mbit/s (scale 1/{out['scale']['scale']:.0f}); "
             f"other runnable tasks at the start: {out.get('others_runnable_start')}",
             scale_sentence(out["scale"]) + "; dp_eth " + f"{out['scale']['tiny']['dp_eth']:.2f} (real "
             f"{out['scale']['real']['dp_eth']:.2f}), pp_eth {out['scale']['tiny']['pp_eth']:.3f} (real "
             f"{out['scale']['real']['pp_eth']:.3f})", verdict_sentence(verdict_of(out)), ""]
    for row in _rows(out):
        lines.append(f"ratio {row['ratio']:g}:1  plan: layers {row['plan']['layers_per_stage']}, "
                     f"ranks {row['plan']['rank_of_logical']}, micro-batch {row['plan']['micro_batch_size']}")
        vpp = row["plan"].get("vpp_plan")
        if vpp and any("vpp" in c["name"] for c in row["configs"]):
            lines.append(f"  interleaved plan (5): vpp {vpp['vpp']}, layers per virtual stage "
                         f"{vpp['layers_per_virtual_stage']}, ranks {vpp['rank_of_logical']}, micro-batch "
                         f"{vpp['micro_batch_size']}, overlap_p2p_comm {vpp['overlap_p2p_comm']}")
        links = row.get("links") or {}
        if links:
            lines.append("  links (largest message; latency): " + ", ".join(
                f"{k} {v['bandwidth'][-1][1] * 1e3:.0f} Mbit/s / {v['latency_us']:.0f} us" for k, v in links.items()))
        lines.append(f"  {'configuration':<20} {'median ms':>10} {'per round ms':>24} {'predicted ms':>13}")
        for c in row["configs"]:
            rounds = ", ".join(f"{t * 1e3:.0f}" for t in c["rounds_s"])
            lines.append(f"  {c['name']:<20} {c['median_s'] * 1e3:10.1f} {rounds:>24} {c['predicted_s'] * 1e3:13.1f}")
        spread = row.get("ratio_spread", {})
        lines.append("  " + "  ".join(f"{k} {v:.2f}" + (f" [{spread[k][0]:.2f}-{spread[k][1]:.2f}]" if k in spread else "")
                                      for k, v in row["ratios"].items()))
        for name, loss in row["losses"].items():
            values = loss["losses"] if isinstance(loss, dict) else loss
            lines.append(f"  {name:<20} losses {', '.join(f'{v:.3f}' for v in values)}")
            for r, lay in enumerate(loss.get("ranks", []) if isinstance(loss, dict) else []):
                groups = "; ".join(f"{g[0]} {g[1]}->{g[2]}" for g in lay["groups"]) or "DeepSpeed's own"
                lines.append(f"    rank {r}: stage {lay['stage']}, parts {lay['parts']}, "
                             f"dp group {lay['dp_group']}, groups: {groups}")
        lines.append("")
    return "\n".join(lines)
