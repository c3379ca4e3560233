"""The stylesheet and script inlined into every HTML report (see :mod:`trainprof.report.html`).

Kept as Python strings, not package data files, so that they ship in every install (sdist,
wheel, editable) without packaging configuration, and so that the report module can hash the
exact script text for its Content-Security-Policy.

The script draws every chart as SVG from the JSON data block ``#tp-data``; it only ever writes
text with ``textContent`` and attributes with ``setAttribute`` (never ``innerHTML``), so no
string from the data can become markup. It computes no metric: it positions, scales and labels
numbers that :mod:`trainprof.analysis.series` prepared.
"""

CSS = """
:root{--fg:#1d2430;--muted:#5b6576;--line:#d9dee6;--bg:#fff;--panel:#f6f8fa;--accent:#0b5cad}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
color:var(--fg);background:var(--bg)}
main{max-width:1280px;margin:0 auto;padding:0 20px 40px}
header.top{background:#16202e;color:#fff;padding:14px 20px}
header.top .inner{max-width:1280px;margin:0 auto}
header.top h1{margin:0;font-size:20px;font-weight:600}
header.top .sub{color:#b9c4d4;font-size:13px;margin-top:4px;word-break:break-all}
nav{position:sticky;top:0;background:#fff;border-bottom:1px solid var(--line);z-index:5;
padding:6px 20px}
nav .inner{max-width:1280px;margin:0 auto;display:flex;gap:14px;flex-wrap:wrap}
nav a{color:var(--accent);text-decoration:none;font-size:13px}
section{margin-top:26px;overflow-x:auto}
h2{font-size:18px;margin:0 0 10px;padding-bottom:4px;border-bottom:2px solid var(--line)}
h3{font-size:15px;margin:14px 0 6px}
h4{font-size:14px;margin:12px 0 4px;color:var(--muted)}
.status{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;
font-weight:600;margin-left:8px;vertical-align:middle}
.status.finished{background:#1e7b34}.status.crashed{background:#b42318}
.status.interrupted{background:#a15c00}.status.running{background:#0b5cad}
.headline{font-size:19px;font-weight:600;margin:14px 0 4px}
.headline.ok{color:#1e7b34}
.tiles{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.tile{background:var(--panel);border:1px solid var(--line);border-radius:6px;padding:8px 12px;
min-width:150px}
.tile .k{font-size:12px;color:var(--muted)}.tile .v{font-size:18px;font-weight:600}
.tile .d{font-size:12px;color:var(--muted)}
.bar{display:flex;height:22px;border-radius:4px;overflow:hidden;border:1px solid var(--line);
margin:6px 0}
.bar span{display:block;height:100%}
.legend{display:flex;gap:14px;flex-wrap:wrap;font-size:12px;color:var(--muted);margin:4px 0}
.legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;
vertical-align:-1px}
.finding{border:1px solid var(--line);border-left:5px solid #999;border-radius:6px;
padding:10px 14px;margin:12px 0;background:#fff}
.finding.high{border-left-color:#b42318}.finding.medium{border-left-color:#c98a00}
.finding.low{border-left-color:#0b5cad}
.finding h3{margin:0 0 4px}
.sev{display:inline-block;font-size:11px;font-weight:700;text-transform:uppercase;
padding:1px 6px;border-radius:3px;color:#fff;background:#999;margin-right:6px;
vertical-align:2px}
.sev.high{background:#b42318}.sev.medium{background:#c98a00}.sev.low{background:#0b5cad}
.meta{color:var(--muted);font-size:13px}
.gain{display:inline-block;width:120px;height:8px;background:#eee;border-radius:4px;
vertical-align:middle;margin-left:6px;overflow:hidden}
.gain span{display:block;height:100%;background:#b42318}
pre{background:#0f1722;color:#d7e3f4;padding:10px 12px;border-radius:6px;overflow:auto;
font-size:12.5px;line-height:1.4}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.crash{border-left:4px solid #b91c1c;padding:4px 12px;margin:8px 0 14px;background:#fef2f2}
.crash pre{margin:4px 0 8px;white-space:pre-wrap}
p code,td code{background:var(--panel);padding:1px 4px;border-radius:3px}
p code.cmd{display:block;white-space:pre;overflow-x:auto;margin:4px 0;padding:3px 6px}
table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:3px 10px 3px 0;text-align:left;
vertical-align:top}
th{color:var(--muted);font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
td.mono{overflow-wrap:anywhere}
table.kv th{width:1%;white-space:nowrap}
.scroll{overflow:auto;max-width:100%}
details summary{cursor:pointer;color:var(--accent)}
.chart{position:relative;margin:4px 0 10px;user-select:none}
.chart .title{font-size:13px;font-weight:600;margin:6px 0 0}
.chart svg{display:block;width:100%;cursor:crosshair}
.chart svg text{font-size:11px;fill:#5b6576}
.controls{display:flex;gap:8px;align-items:center;font-size:12px;color:var(--muted);
margin:6px 0}
.controls button{font:inherit;border:1px solid var(--line);background:#fff;border-radius:4px;
padding:2px 8px;cursor:pointer}
.controls button.on{background:var(--accent);color:#fff;border-color:var(--accent)}
#tp-tip{position:fixed;pointer-events:none;background:rgba(15,23,34,.94);color:#fff;
font-size:12px;padding:6px 8px;border-radius:4px;z-index:20;display:none;max-width:420px;
white-space:nowrap}
#tp-tip div{overflow:hidden;text-overflow:ellipsis}
#tp-tip i{display:inline-block;width:9px;height:9px;border-radius:2px;margin-right:5px}
.callgraph{border:1px solid var(--line);border-radius:6px;overflow:auto;max-height:80vh;
background:#fff}
.callgraph img{display:block;max-width:100%}
.callgraph.full img{max-width:none}
.note{color:var(--muted);font-size:12.5px}
tr.user td{font-weight:700}
td.src{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;
white-space:pre}
.headline.slower{color:#b42318}
tr.explains th,tr.explains td{font-weight:700}
.cmpbar{display:flex;align-items:center;gap:8px;margin:4px 0}
.cmpbar .bar{flex:1;margin:0;border:none;background:transparent}
.cmpbar span{font-size:12px;color:var(--muted)}
footer{margin-top:30px;color:var(--muted);font-size:12px}
"""

JS = r"""
(function () {
"use strict";
var node = document.getElementById("tp-data");
if (!node) { return; }
var D = JSON.parse(node.textContent);
var NS = "http://www.w3.org/2000/svg";
var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
  "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
var uid = 0;

function S(tag, attrs, parent) {
  var e = document.createElementNS(NS, tag);
  for (var k in attrs) { e.setAttribute(k, attrs[k]); }
  if (parent) { parent.appendChild(e); }
  return e;
}
function H(tag, cls, text, parent) {
  var e = document.createElement(tag);
  if (cls) { e.className = cls; }
  if (text !== undefined && text !== null) { e.textContent = text; }
  if (parent) { parent.appendChild(e); }
  return e;
}
function isNum(v) { return typeof v === "number" && isFinite(v); }
function fTime(s) {
  if (!isNum(s)) { return "\u2014"; }
  var a = Math.abs(s);
  if (a >= 1) { return s.toFixed(2) + " s"; }
  if (a >= 1e-3) { return (s * 1e3).toFixed(1) + " ms"; }
  return (s * 1e6).toFixed(0) + " \u00b5s";
}
function fBytes(n) {
  if (!isNum(n)) { return "\u2014"; }
  var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + u[i];
}
function fNum(n) {
  if (!isNum(n)) { return "\u2014"; }
  var a = Math.abs(n);
  if (a !== 0 && (a >= 1e6 || a < 1e-3)) { return n.toExponential(2); }
  return String(+n.toPrecision(4));
}
var FMT = {
  "s": fTime, "B": fBytes,
  "B/s": function (n) { return isNum(n) ? fBytes(n) + "/s" : "\u2014"; },
  "%": function (n) { return isNum(n) ? n.toFixed(1) + "%" : "\u2014"; },
  "cores": function (n) { return isNum(n) ? n.toFixed(2) : "\u2014"; },
  "/s": function (n) { return isNum(n) ? n.toFixed(0) + "/s" : "\u2014"; },
  "": fNum
};
function fmt(unit) { return FMT[unit] || fNum; }

function niceStep(span, n) {
  var raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), e = raw / mag;
  return (e < 1.5 ? 1 : e < 3 ? 2 : e < 7 ? 5 : 10) * mag;
}
function ticks(lo, hi, n) {
  if (!(hi > lo)) { return [lo]; }
  var st = niceStep(hi - lo, n), out = [];
  var v0 = Math.ceil(lo / st) * st;
  for (var k = 0; k < 1000 && v0 + k * st <= hi + st * 1e-9; k++) { out.push(v0 + k * st); }
  return out;
}
// first index i with a[i] >= v (a sorted ascending)
function lower(a, v) {
  var lo = 0, hi = a.length;
  while (lo < hi) { var m = (lo + hi) >> 1; if (a[m] < v) { lo = m + 1; } else { hi = m; } }
  return lo;
}
function r1(v) { return Math.round(v * 10) / 10; }
// ticks for a unit: byte axes step in powers of 1024 (1 GiB, not 1073.7 MB)
function ticksFor(unit, lo, hi, n) {
  if ((unit === "B" || unit === "B/s") && hi >= 1024) {
    var sc = Math.pow(1024, Math.floor(Math.log(hi) / Math.log(1024)));
    return ticks(lo / sc, hi / sc, n).map(function (v) { return v * sc; });
  }
  return ticks(lo, hi, n);
}
// text with a white halo, readable over bars and lines
function label(parent, x, y, text, anchor) {
  var t = S("text", {x: x, y: y, "text-anchor": anchor || "start", stroke: "#fff",
    "stroke-width": 3, "paint-order": "stroke", "stroke-linejoin": "round"}, parent);
  t.textContent = text;
  return t;
}

// ---- tooltip -------------------------------------------------------------------------
var tip = H("div", null, null, document.body);
tip.id = "tp-tip";
function showTip(ev, lines) {
  while (tip.firstChild) { tip.removeChild(tip.firstChild); }
  lines.forEach(function (ln) {
    var row = H("div", null, null, tip);
    if (ln.color) { var sw = H("i", null, null, row); sw.style.background = ln.color; }
    row.appendChild(document.createTextNode(ln.text));
  });
  tip.style.display = "block";
  var x = ev.clientX + 14, y = ev.clientY + 14, w = tip.offsetWidth, h = tip.offsetHeight;
  if (x + w > window.innerWidth - 4) { x = ev.clientX - w - 14; }
  if (y + h > window.innerHeight - 4) { y = ev.clientY - h - 14; }
  tip.style.left = Math.max(0, x) + "px";
  tip.style.top = Math.max(0, y) + "px";
}
function hideTip() { tip.style.display = "none"; }

// ---- x groups: charts that share an x axis, zoom and cursor ----------------------------
var groups = [];
function Group(domains, mode) {
  groups.push(this);
  this.domains = domains; this.mode = mode; this.charts = [];
  this.lo = domains[mode][0]; this.hi = domains[mode][1];
}
Group.prototype.set = function (lo, hi) {
  var f = this.domains[this.mode];
  lo = Math.max(lo, f[0]); hi = Math.min(hi, f[1]);
  // no zooming below what floating point can tell apart
  if (!(hi - lo > 1e-9 * Math.max(1, Math.abs(hi)))) { return; }
  this.lo = lo; this.hi = hi; this.render();
};
Group.prototype.reset = function () { this.set(this.domains[this.mode][0],
  this.domains[this.mode][1]); };
Group.prototype.setMode = function (mode) {
  if (!this.domains[mode]) { return; }
  this.mode = mode; this.lo = this.domains[mode][0]; this.hi = this.domains[mode][1];
  this.render();
};
Group.prototype.render = function () { this.charts.forEach(function (c) { c.render(); }); };
Group.prototype.cursor = function (x) { this.charts.forEach(function (c) { c.cursor(x); }); };
Group.prototype.xLabel = function () {
  return this.mode === "time" ? "time since start (s)" : this.mode === "step" ? "step" : "";
};

// ---- a chart ---------------------------------------------------------------------------
// spec: {title, height, unit, group, layers: [fn(ctx)], ymax: fn(lo,hi), hover: fn(x)->lines,
//        yFixed}
function Chart(parent, spec) {
  this.spec = spec; this.group = spec.group; this.id = "c" + (uid++);
  this.box = H("div", "chart", null, parent);
  this.box.setAttribute("data-chart", spec.key || this.id);
  H("div", "title", spec.title, this.box);
  if (spec.legend) {
    var lg = H("div", "legend", null, this.box);
    spec.legend.forEach(function (it) {
      var s = H("span", null, null, lg), i = H("i", null, null, s);
      i.style.background = it[1];
      s.appendChild(document.createTextNode(it[0]));
    });
  }
  this.svg = S("svg", {"role": "img"}, this.box);
  this.group.charts.push(this);
  this.drag = null;
  var self = this;
  this.svg.addEventListener("mousemove", function (ev) { self.onMove(ev); });
  this.svg.addEventListener("mouseleave", function () { self.group.cursor(null); hideTip(); });
  this.svg.addEventListener("mousedown", function (ev) {
    var x = self.px(ev); if (x === null) { return; }
    self.drag = {x0: x, x1: x}; ev.preventDefault();
  });
  window.addEventListener("mouseup", function () {
    if (!self.drag) { return; }
    var d = self.drag; self.drag = null;
    if (Math.abs(d.x1 - d.x0) > 4) {
      self.group.set(self.inv(Math.min(d.x0, d.x1)), self.inv(Math.max(d.x0, d.x1)));
    } else if (self.sel) { self.sel.setAttribute("visibility", "hidden"); }
  });
  this.svg.addEventListener("dblclick", function () { self.group.reset(); });
}
Chart.prototype.px = function (ev) {
  var r = this.svg.getBoundingClientRect(), x = ev.clientX - r.left;
  if (!this.m || x < this.m.l || x > this.m.l + this.pw) { return null; }
  return x;
};
Chart.prototype.inv = function (px) {
  return this.group.lo + (px - this.m.l) / this.pw * (this.group.hi - this.group.lo);
};
Chart.prototype.onMove = function (ev) {
  var x = this.px(ev);
  if (this.drag && x !== null) {
    this.drag.x1 = x;
    var a = Math.min(this.drag.x0, x), b = Math.max(this.drag.x0, x);
    this.sel.setAttribute("x", a); this.sel.setAttribute("width", b - a);
    this.sel.setAttribute("visibility", "visible");
  }
  if (x === null) { this.group.cursor(null); hideTip(); return; }
  var xv = this.inv(x);
  this.group.cursor(xv);
  var lines = this.spec.hover ? this.spec.hover(xv) : [];
  if (lines && lines.length) { showTip(ev, lines); } else { hideTip(); }
};
Chart.prototype.cursor = function (xv) {
  if (!this.cur) { return; }
  if (xv === null || xv < this.group.lo || xv > this.group.hi) {
    this.cur.setAttribute("visibility", "hidden"); return;
  }
  var x = r1(this.sx(xv));
  this.cur.setAttribute("x1", x); this.cur.setAttribute("x2", x);
  this.cur.setAttribute("visibility", "visible");
};
Chart.prototype.render = function () {
  var spec = this.spec, svg = this.svg, g = this.group;
  while (svg.firstChild) { svg.removeChild(svg.firstChild); }
  var W = Math.max(320, this.box.clientWidth || 900), Hh = spec.height || 150;
  var m = {l: 70, r: 14, t: 10, b: 30};
  this.m = m; this.pw = W - m.l - m.r;
  var ph = Hh - m.t - m.b, pw = this.pw;
  svg.setAttribute("viewBox", "0 0 " + W + " " + Hh);
  svg.setAttribute("width", W); svg.setAttribute("height", Hh);
  var lo = g.lo, hi = g.hi;
  this.box.setAttribute("data-domain", lo + "," + hi);
  var sx = function (x) { return m.l + (x - lo) / (hi - lo) * pw; };
  this.sx = sx;
  var ymax = spec.yFixed || spec.ymax(lo, hi);
  if (!(ymax > 0)) { ymax = 1; }
  var yt = ticksFor(spec.unit, 0, ymax, 4);
  if (!spec.yFixed && yt.length > 1) {
    var st = yt[1] - yt[0];
    if (yt[yt.length - 1] < ymax * 0.999) { yt.push(yt[yt.length - 1] + st); }
    ymax = yt[yt.length - 1];
  }
  this.box.setAttribute("data-ymax", ymax);
  var sy = function (y) { return m.t + ph - Math.min(y, ymax * 1.02) / ymax * ph; };
  var f = fmt(spec.unit);
  yt.forEach(function (v) {
    var y = r1(sy(v));
    S("line", {x1: m.l, x2: m.l + pw, y1: y, y2: y, stroke: "#e8ebf0"}, svg);
    S("text", {x: m.l - 6, y: y + 4, "text-anchor": "end"}, svg).textContent = v === 0 ? "0"
      : f(v);
  });
  var xf = g.mode === "time" ? function (v) { return +v.toPrecision(6) + " s"; }
    : function (v) { return String(+v.toPrecision(8)); };
  ticks(lo, hi, Math.max(2, Math.floor(pw / 110))).forEach(function (v) {
    var x = r1(sx(v));
    S("line", {x1: x, x2: x, y1: m.t + ph, y2: m.t + ph + 4, stroke: "#9aa3b0"}, svg);
    var anchor = x > m.l + pw - 24 ? "end" : "middle";
    S("text", {x: x, y: m.t + ph + 16, "text-anchor": anchor}, svg).textContent = xf(v);
  });
  S("text", {x: m.l + pw, y: Hh - 2, "text-anchor": "end"}, svg).textContent = g.xLabel();
  S("line", {x1: m.l, x2: m.l + pw, y1: m.t + ph, y2: m.t + ph, stroke: "#9aa3b0"}, svg);
  var cid = this.id + "clip";
  var defs = S("defs", {}, svg);
  S("rect", {x: m.l, y: m.t - 1, width: pw, height: ph + 1}, S("clipPath", {id: cid}, defs));
  var plot = S("g", {"clip-path": "url(#" + cid + ")", "class": "plot"}, svg);
  var ctx = {svg: svg, plot: plot, sx: sx, sy: sy, lo: lo, hi: hi, ymax: ymax, m: m,
    pw: pw, ph: ph, mode: g.mode};
  spec.layers.forEach(function (layer) { layer(ctx); });
  this.cur = S("line", {y1: m.t, y2: m.t + ph, stroke: "#16202e", "stroke-width": 1,
    "stroke-dasharray": "3,3", visibility: "hidden"}, svg);
  this.sel = S("rect", {y: m.t, height: ph, fill: "rgba(11,92,173,.15)", stroke: "#0b5cad",
    visibility: "hidden"}, svg);
};

// ---- layers ----------------------------------------------------------------------------
// A line series: xs(mode) -> array of x; y, lo, hi arrays (null = gap).
function lineLayer(series, color) {
  return function (c) {
    var xs = series.xs(c.mode), y = series.y;
    if (!xs) { return; }
    var i0 = Math.max(0, lower(xs, c.lo) - 1), i1 = Math.min(xs.length, lower(xs, c.hi) + 1);
    if (series.lo && series.hi) {
      var run = [];
      var flush = function () {
        if (run.length > 1) {
          var d = "M" + run.map(function (i) {
            return r1(c.sx(xs[i])) + " " + r1(c.sy(series.hi[i]));
          }).join("L");
          for (var j = run.length - 1; j >= 0; j--) {
            d += "L" + r1(c.sx(xs[run[j]])) + " " + r1(c.sy(series.lo[run[j]]));
          }
          S("path", {d: d + "Z", fill: color, "fill-opacity": 0.18, stroke: "none"}, c.plot);
        }
        run = [];
      };
      for (var i = i0; i < i1; i++) {
        if (isNum(series.lo[i]) && isNum(series.hi[i]) && isNum(xs[i])) { run.push(i); }
        else { flush(); }
      }
      flush();
    }
    var d = "", seg = 0;
    var dot = function (k) {  // a point with no neighbour draws no line: mark it
      S("circle", {cx: r1(c.sx(xs[k])), cy: r1(c.sy(y[k])), r: 2.5, fill: color}, c.plot);
    };
    for (var k = i0; k < i1; k++) {
      if (isNum(y[k]) && isNum(xs[k])) {
        d += (seg ? "L" : "M") + r1(c.sx(xs[k])) + " " + r1(c.sy(y[k])); seg++;
      } else {
        if (seg === 1) { dot(k - 1); }
        seg = 0;
      }
    }
    if (seg === 1) { dot(i1 - 1); }
    if (d) {
      S("path", {d: d, fill: "none", stroke: color, "stroke-width": 1.5,
        "stroke-linejoin": "round", "class": "series"}, c.plot);
    }
  };
}
function refLine(value, text) {
  return function (c) {
    if (!isNum(value)) { return; }
    var y = r1(c.sy(value));
    S("line", {x1: c.m.l, x2: c.m.l + c.pw, y1: y, y2: y, stroke: "#16202e",
      "stroke-dasharray": "5,4", "stroke-opacity": 0.6}, c.plot);
    label(c.plot, c.m.l + c.pw - 4, y - 4, text, "end");
  };
}
function bandLayer(x0, x1, text) {
  return function (c) {
    var a = x0(c.mode), b = x1(c.mode);
    if (!isNum(a) || !isNum(b) || b <= c.lo || a >= c.hi) { return; }
    var xa = Math.max(c.m.l, c.sx(a)), xb = Math.min(c.m.l + c.pw, c.sx(b));
    S("rect", {x: r1(xa), y: c.m.t, width: r1(Math.max(1, xb - xa)), height: c.ph,
      fill: "#8c96a6", "fill-opacity": 0.14, "class": "warmup"}, c.plot);
    if (text) {
      S("line", {x1: r1(xb), x2: r1(xb), y1: c.m.t, y2: c.m.t + c.ph, stroke: "#5b6576",
        "stroke-dasharray": "2,3"}, c.plot);
      label(c.plot, r1(xb) + 4, c.m.t + c.ph - 6, "\u25c2 " + text);
    }
  };
}

// ---- the aligned group: steps and samples ---------------------------------------------
var ST = D.steps || {count: 0}, SM = D.samples || {count: 0};
var nb = ST.count ? ST.step.length : 0, K = ST.bucket || 1, S0 = nb ? ST.step[0] : 0;
// in "step" mode a bucket spans its step numbers, so steps left out (profiled) leave a gap
var pos0 = nb ? ST.step : [], pos1 = nb ? ST.step_last.map(function (v) { return v + 1; }) : [];
// time -> step position, piecewise linear through bucket boundaries (display mapping only)
function timeToStep(t) {
  if (!nb || !isNum(t)) { return null; }
  var kt = ST.t0, j = lower(kt, t);
  if (j === 0) {
    var r0 = (pos1[0] - pos0[0]) / Math.max(1e-9, ST.t1[0] - ST.t0[0]);
    return pos0[0] + (t - kt[0]) * r0;
  }
  var a = j - 1, ta = kt[a];
  var tb = j < nb ? kt[j] : ST.t1[nb - 1], pb = j < nb ? pos0[j] : pos1[nb - 1];
  if (t > tb) {
    var rl = (pos1[nb - 1] - pos0[nb - 1]) / Math.max(1e-9, ST.t1[nb - 1] - ST.t0[nb - 1]);
    return pb + (t - tb) * rl;
  }
  return pos0[a] + (t - ta) / Math.max(1e-12, tb - ta) * (pb - pos0[a]);
}
var sampleT = SM.t || [], sampleStep = sampleT.map(timeToStep);
var domains = {};
if (nb) { domains.step = [S0, pos1[nb - 1]]; }
var tmin = Infinity, tmax = -Infinity;
if (nb) { tmin = ST.t0[0]; tmax = ST.t1[nb - 1]; }
if (sampleT.length) {
  tmin = Math.min(tmin, sampleT[0]); tmax = Math.max(tmax, sampleT[sampleT.length - 1]);
}
if (tmax > tmin) { domains.time = [tmin, tmax]; }
var main = domains.step || domains.time ? new Group(domains, domains.step ? "step" : "time")
  : null;
var xsBar0 = function (mode) { return mode === "time" ? ST.t0 : pos0; };
var xsBar1 = function (mode) { return mode === "time" ? ST.t1 : pos1; };
var xsSample = function (mode) { return mode === "time" ? sampleT : sampleStep; };

function barsLayer(c) {
  var x0 = xsBar0(c.mode), x1 = xsBar1(c.mode);
  var i0 = Math.max(0, lower(x1, c.lo)), i1 = Math.min(nb, lower(x0, c.hi) + 1);
  var paths = D.phases.map(function () { return []; }), tall = [];
  var base = c.sy(0);
  for (var i = i0; i < i1; i++) {
    var a = r1(c.sx(x0[i])), b = r1(c.sx(x1[i]));
    if (b - a < 0.4) { b = a + 0.4; }
    var acc = 0;
    for (var p = 0; p < D.phases.length; p++) {
      var v = ST.phases[D.phases[p][0]][i];
      if (!isNum(v) || v <= 0) { continue; }
      var ya = r1(c.sy(acc)), yb = r1(c.sy(acc + v));
      acc += v;
      if (ya - yb < 0.05) { continue; }
      paths[p].push("M" + a + " " + ya + "V" + yb + "H" + b + "V" + ya + "Z");
    }
    if (peak(i) > c.ymax) { tall.push(i); }
  }
  D.phases.forEach(function (ph, p) {
    if (paths[p].length) {
      S("path", {d: paths[p].join(""), fill: ph[2], "class": "bars", "data-phase": ph[0]},
        c.plot);
    }
  });
  if (K > 1) {
    // whiskers: from the bucket's mean up to its slowest step
    var d = "";
    for (var j = i0; j < i1; j++) {
      if (isNum(ST.dur_hi[j]) && ST.dur_hi[j] > ST.dur[j] * 1.05) {
        var y = r1(c.sy(ST.dur_hi[j])), xa = r1(c.sx(x0[j])), xb = r1(c.sx(x1[j]));
        var xm = r1((xa + xb) / 2);
        d += "M" + xa + " " + y + "H" + Math.max(xb, xa + 1) + "M" + xm + " " + y + "V" +
          r1(c.sy(ST.dur[j]));
      }
    }
    if (d) {
      S("path", {d: d, stroke: "#16202e", "stroke-width": 1, fill: "none", "class": "envelope"},
        c.plot);
    }
  }
  // clipped steps: label the tallest ones with their time, without overlapping labels
  tall.sort(function (a, b) { return peak(b) - peak(a); });
  var placed = [];
  tall.forEach(function (i) {
    var x = r1((c.sx(x0[i]) + c.sx(x1[i])) / 2);
    if (placed.length >= 12 || placed.some(function (p) { return Math.abs(p - x) < 70; })) {
      return;
    }
    placed.push(x);
    label(c.plot, x + 3, c.m.t + 11, "\u25b2 " + fTime(peak(i)));
  });
  void base;
}
// the slowest step of bucket i (the step itself when not bucketed)
function peak(i) { return K > 1 ? ST.dur_hi[i] : ST.dur[i]; }
function stepsYmax(lo, hi, mode) {
  var x0 = xsBar0(mode), x1 = xsBar1(mode), w = ST.warmup || 0;
  var i0 = Math.max(0, lower(x1, lo)), i1 = Math.min(nb, lower(x0, hi) + 1);
  // Scale to the steady steps in view. Warm-up steps, and rare outliers more than twice the
  // 99th percentile, are clipped at the top and labelled, so one 30 s compile step or one
  // stall does not flatten every other bar.
  var vals = [], warmVals = [], meanMax = 0;
  for (var i = i0; i < i1; i++) {
    var v = peak(i);
    if (!isNum(v)) { continue; }
    if (i * K < w) { warmVals.push(v); continue; }
    vals.push(v);
    if (isNum(ST.dur[i])) { meanMax = Math.max(meanMax, ST.dur[i]); }
  }
  if (!vals.length) { vals = warmVals; }
  if (!vals.length) { return 0; }
  vals.sort(function (a, b) { return a - b; });
  var mx = vals[vals.length - 1];
  if (vals.length >= 20) {
    var base = Math.max(vals[Math.floor(0.99 * (vals.length - 1))], meanMax);
    if (mx > 2 * base) { return base * 1.1; }
  }
  return mx;
}
function bucketAt(x, mode) {
  var x0 = xsBar0(mode), x1 = xsBar1(mode), i = lower(x1, x);
  if (i >= nb || x < x0[i]) { return -1; }
  return i;
}
function stepsHover(x) {
  var i = bucketAt(x, main.mode);
  if (i < 0) { return []; }
  var n = Math.min(K, ST.count - i * K);
  var head = n > 1 ? "steps " + ST.step[i] + "\u2013" + ST.step_last[i] + " (" + n +
    " steps, mean)" : "step " + ST.step[i];
  if (i * K < (ST.warmup || 0)) { head += " \u00b7 warm-up"; }
  var lines = [{text: head}, {text: "starts at " + ST.t0[i].toFixed(3) + " s"}];
  var dtext = "step time " + fTime(ST.dur[i]);
  if (n > 1) { dtext += " (fastest " + fTime(ST.dur_lo[i]) + ", slowest " + fTime(ST.dur_hi[i])
    + ")"; }
  lines.push({text: dtext});
  D.phases.forEach(function (ph) {
    var v = ST.phases[ph[0]][i];
    if (!isNum(v)) { return; }
    var share = ST.dur[i] > 0 ? " (" + (v / ST.dur[i] * 100).toFixed(1) + "%)" : "";
    lines.push({text: ph[1] + " " + fTime(v) + share, color: ph[2]});
  });
  return lines;
}
function nearestSample(x, mode) {
  var xs = xsSample(mode), j = lower(xs, x);
  if (!xs.length) { return -1; }
  if (j >= xs.length) { j = xs.length - 1; }
  if (j > 0 && Math.abs(xs[j - 1] - x) < Math.abs(xs[j] - x)) { j -= 1; }
  return j;
}
function seriesYmax(list, extra) {
  return function (lo, hi) {
    var mx = extra || 0, mode = main.mode, xs = xsSample(mode);
    var i0 = Math.max(0, lower(xs, lo) - 1), i1 = Math.min(xs.length, lower(xs, hi) + 1);
    list.forEach(function (s) {
      var arr = s.hi || s.y;
      for (var i = i0; i < i1; i++) { if (isNum(arr[i]) && arr[i] > mx) { mx = arr[i]; } }
    });
    return mx;
  };
}

function renderAligned() {
  var host = document.getElementById("tp-steps-chart");
  var util = document.getElementById("tp-util-charts");
  if (!main) { return; }
  var warm = ST.warmup || 0;
  var bands = [bandLayer(
    function (mode) { return nb ? (mode === "time" ? ST.t0[0] : S0) : null; },
    function (mode) {
      if (!warm || !nb) { return null; }
      if (ST.steady_step === null) { return mode === "time" ? ST.t1[nb - 1] : pos1[nb - 1]; }
      return mode === "time" ? ST.steady_t : ST.steady_step;
    }, "warm-up")];
  (ST.profiled || []).forEach(function (w) {
    bands.push(bandLayer(function (mode) { return mode === "time" ? w.t0 : w.first; },
      function (mode) { return mode === "time" ? w.t1 : w.last + 1; }, "profiled"));
  });
  var warmBand = function (c) { bands.forEach(function (b) { b(c); }); };
  if (host && nb) {
    var legend = D.phases.map(function (p) { return [p[1], p[2]]; });
    if (K > 1) { legend.push(["slowest step in each bucket of " + K, "#16202e"]); }
    new Chart(host, {key: "steps", title: "Step time by phase", height: 260, unit: "s",
      group: main, legend: legend,
      layers: [barsLayer, warmBand, refLine(D.median_s, "steady median " + fTime(D.median_s))],
      ymax: function (lo, hi) { return stepsYmax(lo, hi, main.mode); }, hover: stepsHover});
  }
  if (!util) { return; }
  var SE = SM.series || {};
  var mk = function (name, label, color) {
    var s = SE[name];
    if (!s) { return null; }
    return {name: name, label: label, color: color, unit: s.unit, y: s.y, lo: s.lo, hi: s.hi,
      xs: xsSample};
  };
  // the RSS fallback only where workers ran (a run without any has zeros: no legend entry)
  var someWorkers = function (series) {
    return series && series.y.some(function (v) { return v > 0; }) ? series : null;
  };
  var charts = [
    {key: "cpu", title: "CPU busy, in cores" + (SM.n_cores ? " (" + SM.n_cores +
      " usable)" : ""), unit: "cores", ref: SM.n_cores, refLabel: "usable cores",
      series: [mk("sys_cores", "whole system", "#7f7f7f"),
        mk("proc_cores", "training process", "#1f77b4"),
        mk("workers_cores", "DataLoader workers", "#ff7f0e")]},
    {key: "iowait", title: "I/O wait (% of CPU time)", unit: "%",
      series: [mk("iowait_pct", "iowait", "#d62728")]},
    {key: "disk", title: "Disk read rate", unit: "B/s",
      series: [mk("disk_read_bps", "disk read", "#8c564b")]},
    // the workers' private memory: their RSS counts the pages a fork worker shares with
    // the training process once per worker (analysis/memory_growth.workers_private_bytes)
    {key: "memory", title: "Memory: training process RSS, workers' private memory",
      unit: "B",
      series: [mk("rss_bytes", "training process (RSS)", "#1f77b4"),
        mk("workers_private_bytes", "DataLoader workers (private memory, summed)",
          "#ff7f0e") || someWorkers(
        mk("workers_rss_bytes", "DataLoader workers (RSS, shared pages counted in each)",
          "#ff7f0e"))]}
  ];
  var gpuUtil = [], gpuMem = [];
  Object.keys(SE).forEach(function (name, n) {
    var m = /^gpu(\d+)_(util_pct|mem_bytes)$/.exec(name);
    if (!m) { return; }
    var col = PALETTE[(+m[1]) % PALETTE.length];
    if (m[2] === "util_pct") { gpuUtil.push(mk(name, "GPU " + m[1], col)); }
    else { gpuMem.push(mk(name, "GPU " + m[1], col)); }
    void n;
  });
  if (gpuUtil.length) {
    charts.push({key: "gpu_util", title: "GPU utilization", unit: "%", yFixed: 100,
      series: gpuUtil});
  }
  if (gpuMem.length) {
    var total = 0;
    Object.keys(SM.gpu_mem_total || {}).forEach(function (k) {
      total = Math.max(total, SM.gpu_mem_total[k]); });
    charts.push({key: "gpu_mem", title: "GPU memory used", unit: "B", series: gpuMem,
      ref: total || null, refLabel: "device memory"});
  }
  charts.forEach(function (ch) {
    var list = ch.series.filter(function (s) { return s; });
    if (!list.length) { return; }
    var layers = [warmBand];
    list.forEach(function (s) { layers.push(lineLayer(s, s.color)); });
    if (ch.ref) { layers.push(refLine(ch.ref, ch.refLabel + " " + fmt(ch.unit)(ch.ref))); }
    new Chart(util, {key: ch.key, title: ch.title, height: 150, unit: ch.unit, group: main,
      yFixed: ch.yFixed, legend: list.map(function (s) { return [s.label, s.color]; }),
      layers: layers, ymax: seriesYmax(list, ch.ref),
      hover: function (x) {
        var j = nearestSample(x, main.mode);
        if (j < 0) { return []; }
        var out = [{text: "t = " + fNum(sampleT[j]) + " s" + (SM.bucket > 1 ? " (mean of " +
          SM.bucket + " samples)" : "")}];
        list.forEach(function (s) {
          var t = s.label + " " + fmt(s.unit)(s.y[j]);
          if (s.lo && s.hi) { t += " (" + fmt(s.unit)(s.lo[j]) + "\u2013" +
            fmt(s.unit)(s.hi[j]) + ")"; }
          out.push({text: t, color: s.color});
        });
        return out;
      }});
  });
}

function renderTelemetry() {
  var host = document.getElementById("tp-telemetry-charts");
  if (!host || !D.telemetry) { return; }
  D.telemetry.forEach(function (t, n) {
    var xs = t.x.filter(isNum);
    if (!xs.length) { return; }
    var lo = Math.min.apply(null, xs), hi = Math.max.apply(null, xs);
    if (!(hi > lo)) { hi = lo + 1; }
    var g = new Group({own: [lo, hi]}, "own");
    var s = {y: t.y, lo: t.lo, hi: t.hi, xs: function () { return t.x; }};
    var color = PALETTE[n % PALETTE.length];
    new Chart(host, {key: "telemetry-" + n, title: t.name, height: 140, unit: "", group: g,
      layers: [lineLayer(s, color)],
      ymax: function (a, b) {
        var mx = 0, arr = t.hi || t.y;
        for (var i = 0; i < t.x.length; i++) {
          if (t.x[i] >= a && t.x[i] <= b && isNum(arr[i])) { mx = Math.max(mx, arr[i]); }
        }
        return mx;
      },
      hover: function (x) {
        var j = lower(t.x, x);
        if (j >= t.x.length) { j = t.x.length - 1; }
        return [{text: "x = " + fNum(t.x[j])}, {text: t.name + " " + fNum(t.y[j]), color: color}];
      }});
  });
}

function wireControls() {
  var bar = document.getElementById("tp-controls");
  if (!bar || !main) { return; }
  var buttons = [];
  ["step", "time"].forEach(function (mode) {
    if (!domains[mode]) { return; }
    var b = H("button", mode === main.mode ? "on" : "", "x axis: " + (mode === "step" ? "steps"
      : "time"), bar);
    b.type = "button";
    b.addEventListener("click", function () {
      main.setMode(mode);
      buttons.forEach(function (o) { o.className = o === b ? "on" : ""; });
    });
    buttons.push(b);
  });
  var r = H("button", "", "reset zoom", bar);
  r.type = "button";
  r.addEventListener("click", function () { main.reset(); });
  H("span", null, "drag across a chart to zoom, double-click to reset; hover for values", bar);
}

var cg = document.getElementById("tp-callgraph-toggle");
if (cg) {
  cg.addEventListener("click", function () {
    var box = document.getElementById("tp-callgraph");
    box.classList.toggle("full");
    cg.textContent = box.classList.contains("full") ? "fit to width" : "actual size";
  });
}

renderAligned();
renderTelemetry();
wireControls();
function renderAll() { groups.forEach(function (g) { g.render(); }); }
renderAll();
var timer = null;
window.addEventListener("resize", function () {
  clearTimeout(timer);
  timer = setTimeout(renderAll, 150);
});
document.documentElement.setAttribute("data-charts-ready", "1");
})();
"""
