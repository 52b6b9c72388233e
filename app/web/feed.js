// The Train tab's live feed (app/web/feed.py): once a second, while the Train tab is on screen
// and the browser tab is shown, ask the server for what changed (the status line, the side
// chat's header, the plots' new points) and put it in place. It runs in the status line's
// js_on_load; `server.feed` is that component's server function. No Gradio event is involved,
// so the page does none of Gradio's per-event bookkeeping (see feed.py for why that matters).
// The buttons, the banner and the log tail follow Gradio's "look" (train.refresh): the feed
// presses the hidden look button when the run's state differs from the one the last look saw
// (its marker), and every few seconds while the log tail is open and the run moves on.
const EVERY_MS = EVERY_MS_VALUE;
const LOOK_EVERY_MS = 3000;  // at most one look asked per this time (a look takes a round trip)
let known = {}, busy = false, askedAt = 0, logVersion = null;

const onScreen = id => { const e = document.getElementById(id); return !!e && e.offsetParent !== null; };

function plotsHave() {  // what each Train plot holds: its run and the last point of each line
  const out = {};
  for (const [id, s] of Object.entries(window.livetunePlots || {})) {
    if (!id.startsWith('train-plot-')) continue;
    const last = {};
    for (const [n, p] of Object.entries(s.series)) if (p.length) last[n] = p[p.length - 1];
    out[id] = { path: s.path, last };
  }
  return out;
}

function askLook() {
  const now = Date.now();
  if (now - askedAt < LOOK_EVERY_MS) return;
  const button = document.getElementById('train-look');
  if (!button) return;
  askedAt = now;
  button.click();
}

function put(got) {
  if (got.status !== undefined) {
    const mine = element.querySelector('.lt-status');
    if (mine) mine.outerHTML = got.status; else element.innerHTML = got.status;
    known.status = got.status_id;
  }
  if (got.header !== undefined) {
    const p = document.querySelector('#side-chat-about p');
    if (p) { p.innerHTML = got.header; known.header = got.header_id; }
  }
  for (const [id, batch] of Object.entries(got.plots || {})) {
    const plot = (window.livetunePlots || {})[id];
    if (plot && plot.apply) plot.apply(batch);
  }
  known.version = got.version;
}

async function tick() {
  if (busy || document.visibilityState === 'hidden' || !onScreen('train-status')) return;
  const marker = document.querySelector('#train-looked [data-run]');
  const run = marker ? marker.dataset.run : '';
  if (!run) return;
  if (known.run !== run) known = { run };  // another run: the page holds nothing of it yet
  busy = true;
  try {
    const got = await server.feed({ run, have: plotsHave(), known: { ...known } });
    if (!got || got.run !== run || got.error) return;
    put(got);
    const now = document.querySelector('#train-looked [data-run]');
    if (now && now.dataset.run === run && got.state !== now.dataset.state) askLook();
    else if (onScreen('train-log') && got.version !== logVersion) { logVersion = got.version; askLook(); }
  } catch (e) {
    // the server is restarting or the connection dropped: the next tick asks again
  } finally {
    busy = false;
  }
}

// one loop per page, even if this runs again (the status line mounted anew)
if (window.livetuneFeed) clearInterval(window.livetuneFeed);
window.livetuneFeed = setInterval(tick, EVERY_MS);
