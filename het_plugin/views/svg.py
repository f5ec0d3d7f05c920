"""Picture of a plan's placement: clusters as boxes, nodes inside, one cell per rank coloured by
pipeline stage, links between clusters drawn (slow ones dashed red), and a legend.

The layout is computed once as a list of shapes; two small back-ends draw it: SVG text (no dependency)
and PNG through matplotlib (optional: only a dev/user extra). Clusters with very many nodes are
drawn compactly: runs of nodes holding the same coordinates become one box.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Union

from ..core.errors import ConfigError
from ..core.plan import Plan
from .report import all_coords, node_rows

# A 20-colour qualitative palette (matplotlib's tab20 order: strong colours first).
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
           "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]
SLOW = "#b00020"
FAST = "#555555"
MAX_NODES_DRAWN = 256      # beyond this, runs of similar nodes become one box

CELL, GAP, PAD, LABEL_H, TITLE_H = 14, 2, 4, 12, 20
CELLS_PER_ROW = 8
MAX_WIDTH = 960
LEFT = 60                  # room on the left for the links between clusters


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str = "none"
    stroke: str = "#333333"
    width: float = 1.0
    title: str = ""         # hover text (SVG) - which coordinates this cell holds


@dataclass
class Line:
    points: list[tuple[float, float]]
    color: str = FAST
    width: float = 2.0
    dashed: bool = False


@dataclass
class Text:
    x: float
    y: float
    text: str
    size: float = 11
    anchor: str = "start"     # start | middle | end
    bold: bool = False
    color: str = "#000000"


Shape = Union[Rect, Line, Text]


def stage_color(stage: int) -> str:
    return PALETTE[stage % len(PALETTE)]


@dataclass
class _Box:
    """A node (or a run of nodes) to draw: its label and the stage of each of its ranks."""
    label: str
    ranks: list[int]


def _boxes(plan: Plan, cluster_name: str, compact: bool) -> list[_Box]:
    mixed = len({n.accelerator for n in plan.nodes if n.cluster == cluster_name}) > 1
    if not compact:
        return [_Box(n.name + (f" {n.accelerator}" if mixed else ""),
                     list(range(n.first_rank, n.first_rank + n.num_ranks)))
                for n in plan.nodes if n.cluster == cluster_name]
    out = []
    for row in node_rows(plan):
        if row.cluster != cluster_name:
            continue
        per_node = len(row.ranks) // len(row.names)
        out.append(_Box(row.label + (f" {row.accelerator}" if mixed else ""), row.ranks[:per_node]))
    return out


def _link_info(plan: Plan, cluster, a: str, b: str) -> tuple[str, bool]:
    """Label of the link between two clusters and whether it is slow (Ethernet, or slower than a fabric)."""
    if cluster is None:
        return "inter-cluster", True
    link = cluster.cluster_link(a, b)
    fabrics = [cluster.cluster_link(c, c) for c in (a, b)]
    slow = link.kind == "ethernet" or link.gbps < min(f.gbps for f in fabrics)
    return f"{link.kind} {link.gbps:g} Gbit/s", slow


def layout(plan: Plan, cluster=None) -> tuple[list[Shape], float, float]:
    """Shapes of the picture and its width and height in pixels. ``cluster`` adds link speeds."""
    shapes: list[Shape] = []
    names = list(dict.fromkeys(n.cluster for n in plan.nodes))
    compact = len(plan.nodes) > MAX_NODES_DRAWN
    coords = all_coords(plan)
    title = (f"het_plugin plan {plan.hash}: {plan.model.get('name', 'model')} on {plan.cluster_name}  "
             f"tp={plan.tp} cp={plan.cp} pp={plan.pp} dp={plan.dp}")
    shapes.append(Text(10, 20, title, 14, bold=True))
    width = 20 + 9.6 * len(title)          # DejaVu Sans Bold at 14 px averages ~9.5 px a character
    y = 40.0
    spans_y: dict[str, tuple[float, float]] = {}
    for cname in names:
        members = [n for n in plan.nodes if n.cluster == cname]
        boxes = _boxes(plan, cname, compact)
        per_node = max(len(b.ranks) for b in boxes)
        cols = min(per_node, CELLS_PER_ROW)
        rows = math.ceil(per_node / cols)
        label_chars = max(len(b.label) for b in boxes)
        node_w = max(2 * PAD + cols * (CELL + GAP) - GAP, 6.5 * label_chars + 2 * PAD)
        node_h = LABEL_H + 2 * PAD + rows * (CELL + GAP) - GAP
        per_line = max(1, min(len(boxes), int((MAX_WIDTH - LEFT - 16) // (node_w + 8))))
        lines = math.ceil(len(boxes) / per_line)
        box_w = 16 + per_line * (node_w + 8) - 8
        box_h = TITLE_H + 8 + lines * (node_h + 8)
        first = members[0]
        shapes.append(Rect(LEFT, y, box_w, box_h, fill="#f4f4f4", stroke="#222222", width=1.5))
        accs = sorted({f"{n.accelerator} ({n.vendor})" for n in members})
        shapes.append(Text(LEFT + 8, y + 15, f"cluster {cname}: {first.fabric} fabric, {len(members)} nodes, "
                           f"{', '.join(accs)}", 12, bold=True))
        for i, box in enumerate(boxes):
            bx = LEFT + 8 + (i % per_line) * (node_w + 8)
            by = y + TITLE_H + 8 + (i // per_line) * (node_h + 8)
            shapes.append(Rect(bx, by, node_w, node_h, fill="#ffffff", stroke="#888888"))
            shapes.append(Text(bx + PAD, by + LABEL_H - 1, box.label, 9))
            for k, rank in enumerate(box.ranks):
                cx = bx + PAD + (k % cols) * (CELL + GAP)
                cy = by + LABEL_H + PAD + (k // cols) * (CELL + GAP)
                c = coords[rank]
                hover = f"rank {rank}: stage {c['pp']} tp {c['tp']} dp {c['dp']}" + (
                    f" cp {c['cp']}" if plan.cp > 1 else "")
                shapes.append(Rect(cx, cy, CELL, CELL, fill=stage_color(c["pp"]), stroke="#ffffff", width=0.5,
                                   title=hover))
        spans_y[cname] = (y, y + box_h)
        width = max(width, LEFT + box_w + 10)
        y += box_h + 40

    # Links between clusters on the left margin (adjacent pairs innermost); labels go in the gap below
    # the upper cluster of the pair.
    gap_x = {a: LEFT + 8.0 for a in names}
    pairs = sorted(((i, j) for i in range(len(names)) for j in range(i + 1, len(names))),
                   key=lambda p: (p[1] - p[0], p))   # adjacent clusters innermost
    for pair_index, (i, j) in enumerate(pairs):
        a, b = names[i], names[j]
        label, slow = _link_info(plan, cluster, a, b)
        color = SLOW if slow else FAST
        ya = (spans_y[a][0] + spans_y[a][1]) / 2 + 6 * pair_index
        yb = (spans_y[b][0] + spans_y[b][1]) / 2 - 6 * pair_index
        x = LEFT - 16 - 12 * pair_index
        shapes.append(Line([(LEFT, ya), (x, ya), (x, yb), (LEFT, yb)], color, 2.5 if slow else 2, dashed=slow))
        text = f"{a} <-> {b}: {label}" + ("  (slow)" if slow else "")
        shapes.append(Text(gap_x[a], spans_y[a][1] + 25, text, 10, color=color, bold=slow))
        gap_x[a] += 6.2 * len(text) + 24
        width = max(width, gap_x[a])

    # Legend: one swatch per stage (with its layers), then the link styles.
    shapes.append(Text(10, y, "legend", 12, bold=True))
    y += 10
    lx = 10.0
    for s in range(plan.pp):
        text = f"stage {s}: {plan.layers_per_stage[s]} layers"
        w = 22 + 6.5 * len(text)
        if lx + w > max(width, 600):
            lx, y = 10.0, y + 20
        shapes.append(Rect(lx, y, CELL, CELL, fill=stage_color(s), stroke="#ffffff"))
        shapes.append(Text(lx + CELL + 4, y + 11, text, 10))
        lx += w
    y += 26
    shapes.append(Line([(10, y), (50, y)], SLOW, 2.5, dashed=True))
    shapes.append(Text(56, y + 4, "slow link between clusters (Ethernet): only pipeline traffic should cross it", 10))
    y += 18
    shapes.append(Line([(10, y), (50, y)], FAST, 2))
    shapes.append(Text(56, y + 4, "RDMA link between clusters", 10))
    y += 16
    if compact:
        shapes.append(Text(10, y + 4, f"{len(plan.nodes)} nodes: runs of nodes holding the same stage and TP "
                           "coordinates are drawn as one box (one node's ranks shown)", 10))
        y += 16
    return shapes, max(width, 620.0), y + 8


def to_svg(shapes: list[Shape], width: float, height: float) -> str:
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>']
    for s in shapes:
        if isinstance(s, Rect):
            attrs = (f'x="{s.x:.1f}" y="{s.y:.1f}" width="{s.w:.1f}" height="{s.h:.1f}" fill="{s.fill}" '
                     f'stroke="{s.stroke}" stroke-width="{s.width}"')
            if s.title:
                out.append(f"<rect {attrs}><title>{escape(s.title)}</title></rect>")
            else:
                out.append(f"<rect {attrs}/>")
        elif isinstance(s, Line):
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in s.points)
            dash = ' stroke-dasharray="6,4"' if s.dashed else ""
            out.append(f'<polyline points="{pts}" fill="none" stroke="{s.color}" stroke-width="{s.width}"{dash}/>')
        else:
            anchor = {"start": "start", "middle": "middle", "end": "end"}[s.anchor]
            weight = ' font-weight="bold"' if s.bold else ""
            out.append(f'<text x="{s.x:.1f}" y="{s.y:.1f}" font-size="{s.size}" text-anchor="{anchor}" '
                       f'fill="{s.color}"{weight}>{escape(s.text)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(shapes: list[Shape], width: float, height: float, path: Union[str, Path]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        raise ConfigError("PNG output needs matplotlib", field="--svg",
                          fix="pip install matplotlib, or write an .svg file instead") from None
    dpi = 100
    fig = plt.figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    pt = 72 / dpi   # pixels -> points
    for s in shapes:
        if isinstance(s, Rect):
            ax.add_patch(Rectangle((s.x, s.y), s.w, s.h, facecolor=s.fill if s.fill != "none" else "none",
                                   edgecolor=s.stroke, linewidth=s.width * pt))
        elif isinstance(s, Line):
            xs, ys = zip(*s.points)
            ax.plot(xs, ys, color=s.color, linewidth=s.width * pt, linestyle="--" if s.dashed else "-")
        else:
            ax.text(s.x, s.y, s.text, fontsize=s.size * pt, ha={"start": "left", "middle": "center",
                                                                   "end": "right"}[s.anchor],
                    va="baseline", color=s.color, fontweight="bold" if s.bold else "normal")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def draw_plan(plan: Plan, path: Union[str, Path], cluster=None) -> None:
    """Write the placement picture: SVG, or PNG when the path ends in .png."""
    path = Path(path)
    shapes, width, height = layout(plan, cluster)
    if path.suffix.lower() == ".png":
        to_png(shapes, width, height, path)
    elif path.suffix.lower() == ".svg":
        path.write_text(to_svg(shapes, width, height))
    else:
        raise ConfigError(f"cannot draw into {path.name!r}", field="--svg",
                          fix="give a file name ending in .svg or .png")
