"""A plan's graph as a self-contained HTML page (no network): modules collapse, collectives stand out.

The page embeds the plan's nodes and edges as JSON and draws them as SVG with a small
script: ops in layers from the inputs down, filled by pipeline stage, each showing its output
layouts; an edge is labelled with the layout it carries, or, where the plan inserts a
redistribution, drawn red and labelled with its collectives (the layout change on hover).
Every module with more than one op starts collapsed into one box (which counts the
collectives inside it), so a 32-layer model opens as a handful of boxes; clicking a module
box opens it one level, and the list at the top closes it again (``graph.html#open=blocks``
opens modules from the address). An opened module's own ops (in none of its children: a
causal mask built in the model itself), when more than 8, stay in one box until clicked.
"""

from __future__ import annotations

import html
import json
import subprocess
from pathlib import Path
from typing import Any

from autopar.ir.plan import ChoiceKind, Plan
from autopar.ir.report import LEGEND, op_label, step_label

STAGE_COLORS = ("#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd", "#d0e0e3", "#ead1dc")


def plan_graph(plan: Plan) -> dict[str, Any]:
    """Nodes (name, op, module, output layouts, stage) and edges (source, target, label, whether a
    redistribution is inserted) of a plan, as plain data."""
    stages = plan.pipeline.node_stages if plan.pipeline is not None else {}
    moved = {(r.src, r.dst): r for r in plan.redistributions}
    names = {n.name for n in plan.nodes}
    # a parameter sits with the first op using it (so it folds into that op's module); inputs at the root
    home: dict[str, str] = {}
    for n in plan.nodes:
        for src in n.args:
            home.setdefault(src, n.module)
    nodes = [
        {
            "name": n.name,
            "op": op_label(n.op),
            "module": n.module
            if n.op != "placeholder"
            else ("" if n.kind == ChoiceKind.INPUT else home.get(n.name, "")),
            "out": ", ".join(n.outputs),
            "stage": stages.get(n.name),
            "named": plan.named_layouts.get(n.name, "").split(" ")[0],  # vocab-parallel, strided, uneven
        }
        for n in plan.nodes
    ]
    edges = []
    for n in plan.nodes:
        for slot, src in enumerate(n.args):
            if src not in names:
                continue
            r = moved.get((src, n.name))
            if r is None:
                layout = n.operands[slot] if slot < len(n.operands) else None
                edges.append({"src": src, "dst": n.name, "label": layout or "", "moved": False, "title": ""})
                continue
            steps = [step_label(c) for c in r.forward]
            back = [step_label(c) for c in r.backward]
            label = " + ".join(steps) or "local"
            title = f"{r.have} -> {r.need}; backward: {' + '.join(back) or 'local'}"
            edges.append({"src": src, "dst": n.name, "label": label, "moved": True, "title": title})
    return {"nodes": nodes, "edges": edges, "colors": STAGE_COLORS}


def plan_dot(plan: Plan) -> str:
    """The same graph in Graphviz DOT: a box per op, filled by stage; a cluster per module, nested
    as the modules are; edges labelled with their layout, red with their collectives where a
    redistribution is inserted."""
    graph = plan_graph(plan)
    tree: dict[str, Any] = {"nodes": [], "children": {}}
    for n in graph["nodes"]:
        where = tree
        for part in [p for p in n["module"].split(".") if p]:
            where = where["children"].setdefault(part, {"nodes": [], "children": {}})
        where["nodes"].append(n)
    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, style=filled, fontsize=10];"]

    def emit(branch: dict, path: str, indent: str) -> None:
        for n in branch["nodes"]:
            color = STAGE_COLORS[n["stage"] % len(STAGE_COLORS)] if n["stage"] is not None else "#eeeeee"
            label = "\\n".join(x for x in (n["name"], n["op"], n["out"], n["named"]) if x)
            lines.append(f'{indent}"{n["name"]}" [label="{label}", fillcolor="{color}"];')
        for name, child in branch["children"].items():
            sub = f"{path}.{name}" if path else name
            lines.append(f'{indent}subgraph "cluster_{sub}" {{ label="{sub}"; style=rounded;')
            emit(child, sub, indent + "  ")
            lines.append(f"{indent}}}")

    emit(tree, "", "  ")
    for e in graph["edges"]:
        if e["moved"]:
            label = f"{e['title'].split(';')[0]}\\n{e['label']}"
            lines.append(f'  "{e["src"]}" -> "{e["dst"]}" [label="{label}", color=red, fontcolor=red];')
        else:
            lines.append(f'  "{e["src"]}" -> "{e["dst"]}" [label="{e["label"]}", fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def plan_html(plan: Plan, title: str) -> str:
    """The page (see the module docstring)."""
    data = json.dumps(plan_graph(plan)).replace("</", "<\\/")
    page = _PAGE.replace("__TITLE__", html.escape(title)).replace("__STYLE__", _STYLE)
    return page.replace("__SUMMARY__", _summary_lines(plan)).replace("__DATA__", data)


def _summary_lines(plan: Plan) -> str:
    """What the page says above the graph: the predicted step and memory, each axis's role, a legend."""
    p = plan.prediction
    step, memory = plan.step_time_s, plan.peak_memory_bytes
    lines = [
        f"predicted step {step * 1e3:.3f} ms (compute {p.compute_s * 1e3:.3f} ms, communication "
        f"{p.comm_s * 1e3:.3f} ms); memory per rank {memory / 2**20:.1f} MiB",
        *(f"axis {axis}: {role}" for axis, role in plan.axis_roles.items()),
        LEGEND + "; red edges insert collectives, boxes are filled by pipeline stage",
    ]
    return "".join(f"<div>{html.escape(line)}</div>" for line in lines)


def plan_svg(page: str, chromium: str, workdir: Path, opened: str = "") -> str:
    """The graph of ``page`` (from :func:`plan_html`) as a standalone SVG, drawn by the page's own
    script in headless ``chromium`` (one renderer for both); ``opened`` lists modules to open."""
    html_file = workdir / "graph.html"
    html_file.write_text(page)
    dom = subprocess.run(
        [
            chromium,
            *HEADLESS,
            f"--user-data-dir={workdir / 'profile'}",
            "--dump-dom",
            html_file.resolve().as_uri() + (f"#open={opened}" if opened else ""),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    start, end = dom.index('<svg id="graph"'), dom.index("</svg>") + len("</svg>")
    svg = dom[start:end].replace(">", f"><style>{_STYLE}</style>", 1)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + svg + "\n"


# Chromium headless with nothing reaching out: no background networking, updates or sync
HEADLESS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
_STYLE = """
text { font: 12px sans-serif; }
.op rect { stroke: #555; }
.module rect { stroke: #333; stroke-dasharray: 4 2; cursor: pointer; }
.edge { fill: none; stroke: #999; }
.edge.moved { stroke: #d00; stroke-width: 2; }
.elabel { fill: #d00; font-size: 10px; }
.llabel { fill: #777; font-size: 9px; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 12px sans-serif; margin: 8px; }
#open button { margin: 2px; font-size: 11px; }
__STYLE__
</style></head>
<body>
<h3>__TITLE__</h3>
__SUMMARY__
<div>Click a dashed module box to open it; red edges insert collectives (hover for layouts).
Open modules: <span id="open"></span> <button id="all">close all</button></div>
<svg id="graph" xmlns="http://www.w3.org/2000/svg"></svg>
<script>
const D = __DATA__;
const NS = "http://www.w3.org/2000/svg";
const count = {};
for (const n of D.nodes) {
  const parts = n.module ? n.module.split(".") : [];
  for (let i = 1; i <= parts.length; i++) {
    const p = parts.slice(0, i).join(".");
    count[p] = (count[p] || 0) + 1;
  }
}
const closed = new Set(Object.keys(count).filter(p => count[p] > 1));
// a module's own ops (in no child module: a causal mask built in the model itself), when many,
// stay folded in one box of their own once the module is opened, until that box is clicked
const own = {};
for (const n of D.nodes) if (n.module) own[n.module] = (own[n.module] || 0) + 1;
const parents = new Set(Object.keys(count).map(p => p.split(".").slice(0, -1).join(".")));
const ownClosed = new Set(Object.keys(own).filter(m => own[m] > 8 && parents.has(m)));
// graph.html#open=blocks,blocks.0 opens those modules (a link to a view)
const wanted = decodeURIComponent(location.hash).match(/^#open=(.*)$/);
if (wanted) for (const p of wanted[1].split(",")) closed.delete(p);
function unitOf(n) {
  const parts = n.module ? n.module.split(".") : [];
  for (let i = 1; i <= parts.length; i++) {
    const p = parts.slice(0, i).join(".");
    if (closed.has(p)) return "module:" + p;
  }
  if (ownClosed.has(n.module)) return "own:" + n.module;
  return n.name;
}
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  parent.appendChild(e);
  return e;
}
// the x of the edge's cubic (control points half a gap below and above its ends) at height y
function xAtY(y, [x1, y1, x2, y2], GY) {
  const at = (t, a, b, c, d) =>
    (1 - t) ** 3 * a + 3 * (1 - t) ** 2 * t * b + 3 * (1 - t) * t * t * c + t ** 3 * d;
  const down = y2 >= y1;
  let lo = 0, hi = 1;
  for (let i = 0; i < 30; i++) {
    const mid = (lo + hi) / 2, ym = at(mid, y1, y1 + GY / 2, y2 - GY / 2, y2);
    if ((ym < y) === down) lo = mid; else hi = mid;
  }
  return at(lo, x1, x1, x2, x2);
}
// an edge label in a gap between rows the edge crosses (the one above its target first), moved
// up or down within the gap, or to an earlier gap, until it overlaps no label placed before it;
// a label with no free place is left off (the edge's hover still shows it)
function placeLabel(svg, placed, cls, text, [x1, y1, x2, y2, r1, r2], H, GY) {
  const t = el("text", { class: cls }, svg);
  t.textContent = text;
  const w = t.getComputedTextLength() || 6 * text.length, h = 11;
  const clear = b => placed.every(o => b.x2 < o.x1 || o.x2 < b.x1 || b.y2 < o.y1 || o.y2 < b.y1);
  const gaps = [];
  for (let r = Math.max(r1, r2) - 1; r >= Math.min(r1, r2); r--) gaps.push(10 + r * (H + GY) + H + GY / 2);
  for (const mid of gaps) {
    for (const dy of [4, -9, 17]) {
      const y = mid + dy, x = xAtY(y - 4, [x1, y1, x2, y2], GY) + 4;
      const box = { x1: x, x2: x + w, y1: y - h + 2, y2: y + 2 };
      if (clear(box)) {
        placed.push(box);
        t.setAttribute("x", x);
        t.setAttribute("y", y);
        return;
      }
    }
  }
  t.remove();
}
function render() {
  const svg = document.getElementById("graph");
  svg.innerHTML = "";
  const units = new Map();
  const unitOfNode = {};
  D.nodes.forEach((n, i) => {
    const u = unitOf(n);
    unitOfNode[n.name] = u;
    if (!units.has(u)) {
      const isModule = u.startsWith("module:"), isOwn = u.startsWith("own:");
      units.set(u, { key: u, order: i, module: isModule ? u.slice(7) : isOwn ? u.slice(4) : null,
                     own: isOwn, ops: 0, inner: 0, stage: n.stage,
                     lines: isModule ? [] : [n.name, n.op, n.out, n.named].filter(x => x) });
    }
    units.get(u).ops += 1;
  });
  const links = new Map();
  for (const e of D.edges) {
    const a = unitOfNode[e.src], b = unitOfNode[e.dst];
    if (a === undefined || b === undefined) continue;
    if (a === b) {  // inside one box: a closed module counts the collectives it hides
      if (e.moved) units.get(a).inner += 1;
      continue;
    }
    const k = a + "->" + b;
    const l = links.get(k) || { a, b, moved: false, labels: [], titles: [], layouts: [] };
    if (e.moved) {
      l.moved = true; l.labels.push(e.label); l.titles.push(e.title);
    } else {
      l.layouts.push(e.label);
    }
    links.set(k, l);
  }
  const layer = new Map();
  const ordered = [...units.values()].sort((x, y) => x.order - y.order);
  for (const u of ordered) layer.set(u.key, 0);
  for (const u of ordered) {
    for (const l of links.values()) {
      if (l.b === u.key && units.get(l.a).order < u.order) {
        layer.set(u.key, Math.max(layer.get(u.key), layer.get(l.a) + 1));
      }
    }
  }
  const rows = [];
  for (const u of ordered) {
    const r = layer.get(u.key);
    (rows[r] = rows[r] || []).push(u);
  }
  const W = 170, H = 46, GX = 30, GY = 46;
  const pos = {};
  let width = 0;
  rows.forEach((row, r) => row.forEach((u, c) => {
    pos[u.key] = { x: 10 + c * (W + GX), y: 10 + r * (H + GY) };
    width = Math.max(width, 10 + (c + 1) * (W + GX));
  }));
  svg.setAttribute("width", width);
  svg.setAttribute("height", 20 + rows.length * (H + GY));
  const labelled = [];
  for (const l of links.values()) {
    const p = pos[l.a], q = pos[l.b];
    const x1 = p.x + W / 2, y1 = p.y + H, x2 = q.x + W / 2, y2 = q.y;
    const path = el("path", { class: "edge" + (l.moved ? " moved" : ""),
      d: `M${x1},${y1} C${x1},${y1 + GY / 2} ${x2},${y2 - GY / 2} ${x2},${y2}` }, svg);
    el("title", {}, path).textContent = l.moved ? l.titles.join("\\n") : l.layouts.join(", ");
    const curve = [x1, y1, x2, y2, layer.get(l.a), layer.get(l.b)];
    if (l.moved) {
      const more = l.labels.length > 1 ? ` (+${l.labels.length - 1})` : "";
      labelled.push(["elabel", l.labels[0] + more, curve]);
    } else if (new Set(l.layouts).size === 1 && l.layouts[0]) {
      labelled.push(["llabel", l.layouts[0], curve]);
    }
  }
  // collectives first: where two labels would overlap, the layout one moves (or goes)
  labelled.sort((x, y) => (x[0] === "elabel" ? 0 : 1) - (y[0] === "elabel" ? 0 : 1));
  const placed = [];
  for (const [cls, text, curve] of labelled) placeLabel(svg, placed, cls, text, curve, H, GY);
  for (const u of ordered) {
    const p = pos[u.key];
    const g = el("g", { class: u.module ? "module" : "op", transform: `translate(${p.x},${p.y})` }, svg);
    const fill = u.stage === null || u.stage === undefined ? "#eeeeee" : D.colors[u.stage % D.colors.length];
    el("rect", { width: W, height: H, rx: u.module ? 8 : 3, fill }, g);
    const hidden = u.inner ? `, ${u.inner} collective${u.inner > 1 ? "s" : ""}` : "";
    const lines = u.module ? [u.module, `+ ${u.ops} ${u.own ? "own " : ""}ops${hidden}`] : u.lines;
    lines.forEach((t, i) => {
      el("text", { x: 6, y: 14 + i * 13, "font-weight": i === 0 ? "bold" : "normal" }, g).textContent =
        t.length > 28 ? t.slice(0, 27) + "\u2026" : t;
    });
    if (u.module) {
      g.addEventListener("click", () => { (u.own ? ownClosed : closed).delete(u.module); render(); });
    }
  }
  const open = document.getElementById("open");
  open.innerHTML = "";
  for (const p of Object.keys(count).filter(p => count[p] > 1 && !closed.has(p))) {
    const b = document.createElement("button");
    b.textContent = "close " + p;
    b.onclick = () => { closed.add(p); render(); };
    open.appendChild(b);
  }
}
document.getElementById("all").onclick = () => {
  for (const p of Object.keys(count)) if (count[p] > 1) closed.add(p);
  render();
};
render();
</script>
</body></html>
"""
