"""The report's HTML page: one file that needs nothing else, with plotly.js inlined (no server, no CDN).

A page is sections of panels. A panel is a plotly figure with its title and a caption saying how to read it,
or, when its data is missing, the reason in its place. Each figure is stored in the page as JSON (a
``<script type="application/json" data-figure=...>`` element) and drawn by the page's own script; when every
figure is drawn, that script sets ``data-drawn`` on the ``#report-status`` element (and ``data-errors`` if
anything failed), which the browser test reads back from the rendered page.
"""
from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

# Tableau 10: one colour per run, distinct for the colour-blind in the first few.
RUN_COLOURS = ("#4e79a7", "#e15759", "#59a14f", "#b07aa1", "#f28e2b", "#76b7b2", "#edc948", "#ff9da7",
               "#9c755f", "#bab0ac")
STATUS_ID = "report-status"
# Plotly's modebar without the link to plotly's site: the page makes no request of its own.
PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def run_colour(index: int) -> str:
    return RUN_COLOURS[index % len(RUN_COLOURS)]


@dataclass(frozen=True)
class Panel:
    key: str                      # the panel's id in the page, e.g. "ttft-cdf"
    title: str
    caption: str                  # what it shows and how to read it
    figure: Optional[object]      # a plotly Figure, or None when there is nothing to draw
    missing: Optional[str] = None   # why nothing, or not every run, is drawn
    wide: bool = False            # the page's full width rather than half


@dataclass(frozen=True)
class Section:
    title: str
    intro: str
    panels: Sequence[Panel]
    table_html: str = ""          # an HTML table shown above the panels (already escaped)


@dataclass
class Page:
    title: str
    subtitle: str
    sections: list[Section] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)   # what the reader should know before the panels


def _figure_json(figure) -> str:
    import plotly.io

    text = plotly.io.to_json(figure, validate=False)
    # Inside <script>, "</" could close the element; JSON reads "<\/" back as "</".
    return text.replace("</", "<\\/")


def _panel_html(panel: Panel) -> str:
    classes = "panel wide" if panel.wide else "panel"
    parts = [f'<figure class="{classes}" id="panel-{panel.key}">', f"<h3>{html.escape(panel.title)}</h3>"]
    if panel.figure is not None:
        parts.append(f'<div class="plot" id="plot-{panel.key}"></div>')
        parts.append(f'<script type="application/json" data-figure="plot-{panel.key}">'
                     f"{_figure_json(panel.figure)}</script>")
    if panel.missing:
        parts.append(f'<p class="missing">{html.escape(panel.missing)}</p>')
    parts.append(f"<figcaption>{html.escape(panel.caption)}</figcaption></figure>")
    return "\n".join(parts)


DRAW_SCRIPT = """
(function () {
  var status = document.getElementById("%(status)s");
  var errors = [];
  window.addEventListener("error", function (event) {
    errors.push(String(event.message));
    status.setAttribute("data-errors", errors.join(" | "));
  });
  var nodes = document.querySelectorAll("script[data-figure]");
  var drawn = 0;
  var jobs = [];
  nodes.forEach(function (node) {
    var id = node.getAttribute("data-figure");
    try {
      var spec = JSON.parse(node.textContent);
      jobs.push(Plotly.newPlot(document.getElementById(id), spec.data, spec.layout, %(config)s)
        .then(function () { drawn += 1; }, function (error) { errors.push(id + ": " + error); }));
    } catch (error) {
      errors.push(id + ": " + error.message);
    }
  });
  Promise.all(jobs).then(function () {
    status.setAttribute("data-drawn", String(drawn));
    status.setAttribute("data-errors", errors.join(" | "));
    status.className = errors.length ? "status failed" : "status done";
    status.textContent = errors.length ? "could not draw: " + errors.join("; ")
                                       : "drew " + drawn + " of " + nodes.length + " figures";
  });
})();
"""

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto; max-width: 1400px;
       padding: 16px 24px 48px; color: #222; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 21px; margin: 36px 0 6px; border-bottom: 2px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 16px; margin: 4px 0 6px; }
p.subtitle { color: #555; margin: 0 0 12px; }
p.intro { color: #444; margin: 4px 0 12px; max-width: 1100px; }
.grid { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 18px; }
figure.panel { margin: 0; padding: 10px 12px; border: 1px solid #e3e3e3; border-radius: 6px; }
figure.wide { grid-column: 1 / -1; }
figcaption { color: #555; font-size: 13px; margin-top: 4px; }
p.missing { background: #fff6e0; border-left: 4px solid #f2b705; padding: 6px 10px; font-size: 14px; }
div.notices { background: #fff6e0; border-left: 4px solid #f2b705; padding: 6px 14px; margin: 10px 0; }
div.notices li { margin: 3px 0; }
table.runs { border-collapse: collapse; font-size: 13px; margin: 6px 0 10px; }
table.runs th, table.runs td { border: 1px solid #ddd; padding: 4px 8px; text-align: right; vertical-align: top; }
table.runs th:first-child, table.runs td:first-child { text-align: left; }
table.runs td.text { text-align: left; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
.status { position: fixed; top: 6px; right: 10px; font-size: 12px; padding: 3px 8px; border-radius: 4px;
          background: #eee; color: #444; }
.status.failed { background: #fde2e2; color: #8a1f1f; }
"""


def render(page: Page) -> str:
    """The page as one HTML document, plotly.js inlined."""
    from plotly.offline import get_plotlyjs

    body = [f"<h1>{html.escape(page.title)}</h1>", f'<p class="subtitle">{html.escape(page.subtitle)}</p>']
    if page.notices:
        body.append('<div class="notices"><ul>' + "".join(f"<li>{html.escape(n)}</li>" for n in page.notices)
                    + "</ul></div>")
    for section in page.sections:
        slug = "".join(c if c.isalnum() else "-" for c in section.title.lower())
        body.append(f'<section id="section-{slug}"><h2>{html.escape(section.title)}</h2>')
        if section.intro:
            body.append(f'<p class="intro">{html.escape(section.intro)}</p>')
        body.append(section.table_html)
        body.append('<div class="grid">' + "\n".join(_panel_html(p) for p in section.panels) + "</div></section>")
    script = DRAW_SCRIPT % {"status": STATUS_ID, "config": json.dumps(PLOT_CONFIG)}
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(page.title)}</title>", f"<style>{STYLE}</style>",
        f'<script type="text/javascript">{get_plotlyjs()}</script>', "</head>", "<body>",
        f'<div id="{STATUS_ID}" class="status" data-drawn="0" data-errors="">drawing…</div>',
        *body, f"<script>{script}</script>", "</body>", "</html>", ""])
