// The live plots of the web app (app/web/plots.py): `element` is the plot's gr.HTML element and
// `props.value` a JSON batch from the server ({path, seq, series: {name: {reset, points}}}); the
// Train tab's plots get theirs from the live feed (feed.js) instead.
// A batch holds only the points this page does not have yet (it says what it has through
// window.livetunePlots, read by the live feed), so the page appends and redraws one small
// SVG instead of receiving and re-embedding the whole history. Smoothing and the log scale are
// drawn here, without a round trip.
const MAX_DRAWN = 400;   // points drawn per line (the full history stays in events.jsonl)
const MAX_KEPT = 20000;  // points kept per line in the page before the older half is thinned
const spec = JSON.parse(element.querySelector('.lt-plot').dataset.spec);
const store = { path: null, series: {}, log: false, smoothing: spec.smoothing ?? 0 };
// the Train tab's plots are fed by the live feed (feed.js), which hands its batches to `apply`
window.livetunePlots = window.livetunePlots || {};
window.livetunePlots[spec.id] = store;

const svgNS = 'http://www.w3.org/2000/svg';
const box = element.querySelector('.lt-plot');
const canvas = box.querySelector('.lt-canvas');
const empty = box.querySelector('.lt-empty');
const legend = box.querySelector('.lt-legend');
// a plot only some runs have is hidden, its whole block (the element that carries its id), until
// a point comes (draw shows it)
const block = element.closest('#' + spec.id) || element;
if (spec.hide_empty) block.style.display = 'none';

function apply(text) {
  if (!text) return;
  let batch;
  try { batch = JSON.parse(text); } catch (e) { return; }
  if (batch.path !== store.path) { store.path = batch.path; store.series = {}; }
  for (const [name, part] of Object.entries(batch.series || {})) {
    let points = part.reset ? [] : (store.series[name] || []);
    if (part.points.length) {  // a rewound run (resumed from an earlier step) replaces the tail
      const first = part.points[0][0];
      while (points.length && points[points.length - 1][0] >= first) points.pop();
    }
    points = points.concat(part.points);
    if (points.length > MAX_KEPT) {
      const half = Math.floor(points.length / 2);
      points = points.slice(0, half).filter((_, i) => i % 2 === 0).concat(points.slice(half));
    }
    store.series[name] = points;
  }
  schedule();
}
store.apply = apply;

let pending = false;
function schedule() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => { pending = false; draw(); });
}

function thin(points) {
  if (points.length <= MAX_DRAWN) return points;
  const stride = points.length / MAX_DRAWN, out = [];
  for (let i = 0; i < MAX_DRAWN - 1; i++) out.push(points[Math.floor(i * stride)]);
  out.push(points[points.length - 1]);
  return out;
}

function smooth(points, weight) {  // TensorBoard's debiased exponential moving average
  let avg = 0, n = 0;
  return points.map(([s, v]) => { n += 1; avg = weight * avg + (1 - weight) * v; return [s, avg / (1 - weight ** n)]; });
}

function niceTicks(lo, hi, count, integer) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-9 * step; t += step) out.push(t);
  return out;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
  return +v.toPrecision(3) + '';
}

function el(tag, attrs, parent) {
  const node = document.createElementNS(svgNS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

// one panel: lines (name, points, colour, dots) on shared axes, inside [x0, y0, w, h]
function panel(svg, lines, x0, y0, w, h, steps, log, title) {
  const all = lines.flatMap(l => l.points.map(p => p[1])).filter(v => Number.isFinite(v) && (!log || v > 0));
  if (!all.length) return;
  const ty = v => log ? Math.log10(v) : v;
  let lo = Math.min(...all.map(ty)), hi = Math.max(...all.map(ty));
  if (hi - lo <= Math.abs(hi) * 1e-9) { const pad = Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }  // a flat line
  const pad = (hi - lo) * 0.05; lo -= pad; hi += pad;
  const left = x0 + 52, right = x0 + w - 8, top = y0 + (title ? 16 : 6), bottom = y0 + h - 20;
  const sx = s => left + (steps[1] > steps[0] ? (s - steps[0]) / (steps[1] - steps[0]) : 0.5) * (right - left);
  const sy = v => bottom - (ty(v) - lo) / (hi - lo) * (bottom - top);
  const titleFill = spec.compare || spec.grouped ? 'currentColor' : lines[0].color;
  if (title) el('text', { x: left, y: y0 + 12, class: 'lt-title', fill: titleFill }, svg).textContent = title;
  el('rect', { x: left, y: top, width: right - left, height: bottom - top, class: 'lt-frame' }, svg);
  for (const t of niceTicks(lo, hi, 4, false)) {
    const y = bottom - (t - lo) / (hi - lo) * (bottom - top);
    el('line', { x1: left, x2: right, y1: y, y2: y, class: 'lt-grid' }, svg);
    el('text', { x: left - 4, y: y + 3, class: 'lt-tick', 'text-anchor': 'end' }, svg).textContent = fmt(log ? 10 ** t : t);
  }
  for (const t of niceTicks(steps[0], steps[1], 6, true)) {
    // a label at the right edge ends there (centred, "1000" would run past the picture and be cut)
    const anchor = sx(t) > right - 16 ? 'end' : 'middle';
    el('text', { x: sx(t), y: bottom + 13, class: 'lt-tick', 'text-anchor': anchor }, svg).textContent = t;
  }
  for (const line of lines) {
    const pts = thin(line.points.filter(p => Number.isFinite(p[1]) && (!log || p[1] > 0)));
    if (!pts.length) continue;
    const d = pts.map((p, i) => (i ? 'L' : 'M') + sx(p[0]).toFixed(1) + ' ' + sy(p[1]).toFixed(1)).join('');
    const path = el('path', { d, fill: 'none', stroke: line.color, 'stroke-width': line.width || 1.5,
                              'data-series': line.name, opacity: line.opacity || 1 }, svg);
    if (line.dash) path.setAttribute('stroke-dasharray', line.dash);
    if (line.dots) for (const p of pts) el('circle', { cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: line.color }, svg);
  }
}

// compare mode: series are named "kind · run"; each run keeps one colour across the plots
function lineStyle(name, i) {
  if (spec.grouped) {  // "panel · line": a panel per group, a line's colour by its label (chosen, rejected, eval)
    const [kind, line] = name.split(' · ');
    return { color: spec.colors[line] || spec.palette[i % spec.palette.length], kind, run: line,
             eval: /^eval/.test(line) };
  }
  if (!spec.compare) {
    const color = spec.colors[name] || spec.palette[i % spec.palette.length];
    return { color, kind: name, eval: name === 'eval' };
  }
  const [kind, run] = name.split(' · ');
  // a branch's steps given up by a rewind ("main (abandoned 1)"): grey and dashed
  const base = r => (r || '').replace(/ \(abandoned \d+\)$/, '');
  const runs = [...new Set(Object.keys(store.series).map(n => base(n.split(' · ')[1])))].sort();
  if (base(run) !== run) return { color: '#9ca3af', dash: '5 4', kind, run, eval: /eval/.test(kind) };
  return { color: spec.palette[runs.indexOf(run) % spec.palette.length], kind, run, eval: /eval/.test(kind) };
}

function draw() {
  // grouped panels keep the server's order (rewards first); the others go by name
  const names = Object.keys(store.series).filter(n => store.series[n].length);
  if (!spec.grouped) names.sort();
  empty.style.display = names.length ? 'none' : '';
  if (spec.hide_empty) block.style.display = names.length ? '' : 'none';
  canvas.replaceChildren();
  legend.replaceChildren();
  if (!names.length) return;
  const lines = [], keys = new Map();
  names.forEach((name, i) => {
    const style = lineStyle(name, i), points = store.series[name];
    const label = spec.compare || spec.grouped ? style.run : name;
    if (!style.eval && spec.smoothable && store.smoothing > 0) {
      // one line per series (compared runs, a panel's lines): its raw points faded under its smoothing
      const own = spec.compare || spec.grouped;
      const faded = own ? style.color : (spec.colors.raw_faded || style.color);
      lines.push({ name, kind: style.kind, points, color: faded, opacity: 0.3, width: 1 });
      lines.push({ name: own ? name : 'smoothed', kind: style.kind, points: smooth(points, store.smoothing),
                   color: style.color, width: 2 });
      if (!own) keys.set('raw', faded);
      keys.set(own ? label : 'smoothed', style.color);
    } else {
      lines.push({ name, kind: style.kind, points, color: style.color, dots: style.eval || (spec.panels && !spec.grouped),
                   width: style.eval ? 2.5 : 1.5, dash: style.dash });
      keys.set(label, style.color);
    }
  });
  // evaluation lines are drawn last, so they lie over the train loss
  lines.sort((a, b) => (a.kind.includes('eval')) - (b.kind.includes('eval')));
  const steps = [Math.min(...lines.map(l => l.points[0][0])), Math.max(...lines.map(l => l.points[l.points.length - 1][0]))];
  const w = Math.max(240, canvas.clientWidth || box.clientWidth || 400);
  // panels: one per kind (an evaluation metric, a group), each with its own scale; grouped
  // panels side by side as the width allows (at least 300 px each)
  const kinds = spec.panels ? [...new Set(lines.map(l => l.kind))] : [null];
  const cols = spec.grouped ? Math.max(1, Math.min(kinds.length, Math.floor(w / 300))) : 1;
  const pw = w / cols, ph = spec.panels ? 110 : spec.height;
  const h = spec.panels ? Math.ceil(kinds.length / cols) * ph : spec.height;
  const svg = el('svg', { width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  kinds.forEach((kind, i) => {
    const mine = kind === null ? lines : lines.filter(l => l.kind === kind);
    panel(svg, mine, (i % cols) * pw, Math.floor(i / cols) * (spec.panels ? ph : 0), pw, ph, steps,
          !spec.panels && store.log, spec.panels ? kind : null);
  });
  canvas.appendChild(svg);
  for (const [label, color] of keys) {
    const item = document.createElement('span');
    item.className = 'lt-key';
    item.innerHTML = `<i style="background:${color}"></i>`;
    item.appendChild(document.createTextNode(label));
    legend.appendChild(item);
  }
  if (spec.compare && !spec.panels) {
    const note = document.createElement('span');
    note.className = 'lt-key';
    note.textContent = '● dots: evaluation loss';
    legend.appendChild(note);
  }
}

const logBox = box.querySelector('.lt-log input');
if (logBox) logBox.addEventListener('change', () => { store.log = logBox.checked; schedule(); });
const slider = box.querySelector('.lt-smooth input');
if (slider) slider.addEventListener('input', () => {
  store.smoothing = +slider.value;
  box.querySelector('.lt-smooth output').textContent = (+slider.value).toFixed(2);
  schedule();
});
new ResizeObserver(schedule).observe(box);
apply(props.value);
watch('value', () => apply(props.value));
