// The page's live feed (app/web/feed.py): once a second, while the Train or the Chat tab is on
// screen and the browser tab is shown, ask the server for what changed in what those tabs show
// (the Train tab: the status line, the side chat's header, the plots' new points; the Chat tab:
// its header) and put it in place. It runs in the js_on_load of a hidden element beside the
// tabs; `server.feed` is that element's server function. No Gradio event is involved, so the
// page does none of Gradio's per-event bookkeeping (see feed.py for why that matters).
// The Train tab's buttons, banner and log tail follow Gradio's "look" (train.refresh): while
// that tab shows, the feed presses the hidden look button when the run's state differs from the
// one the last look saw (its marker), and every few seconds while the log tail is open and the
// run moves on.
const EVERY_MS = EVERY_MS_VALUE;
const LOOK_EVERY_MS = 3000;  // at most one look asked per this time (a look takes a round trip)
const HEADERS = ['side-chat-about', 'chat-about'];  // the chat headers the feed keeps live
let known = {}, busy = false, askedAt = 0, logVersion = null;

const onScreen = id => { const e = document.getElementById(id); return !!e && e.offsetParent !== null; };
// a header's first paragraph is the "Talking to run ..." line (a note may follow it)
const headerLine = id => document.querySelector(`#${id} p`);

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

// the digest of the header the shown tabs hold: the one the feed wrote, while every shown header
// still holds it (a header Gradio drew since, e.g. after an answer, has none: it is sent again)
function headerKnown() {
  const found = new Set(HEADERS.filter(onScreen).map(id => (headerLine(id) || {}).dataset?.feed || ''));
  return found.size === 1 ? [...found][0] : '';
}

function askLook() {
  const now = Date.now();
  if (now - askedAt < LOOK_EVERY_MS) return;
  const button = document.getElementById('train-look');
  if (!button) return;
  askedAt = now;
  button.click();
}

function put(got, train) {
  if (got.status !== undefined) {
    const shown = document.querySelector('#train-status .lt-status');
    if (shown) { shown.outerHTML = got.status; known.status = got.status_id; }
  }
  if (got.header !== undefined) {
    for (const id of HEADERS) {
      const p = headerLine(id);
      if (p) { p.innerHTML = got.header; p.dataset.feed = got.header_id; }
    }
  }
  for (const [id, batch] of Object.entries(got.plots || {})) {
    const plot = (window.livetunePlots || {})[id];
    if (plot && plot.apply) plot.apply(batch);
  }
  if (train) known.version = got.version;  // the plots' version: only when they were asked for
}

async function tick() {
  if (busy || document.visibilityState === 'hidden') return;
  const train = onScreen('train-status');
  if (!train && !onScreen('chat-about')) return;
  const marker = document.querySelector('#train-looked [data-run]');
  const run = marker ? marker.dataset.run : '';
  if (!run) return;
  if (known.run !== run) known = { run };  // another run: the page holds nothing of it yet
  busy = true;
  try {
    const want = [...(train ? ['status', 'plots'] : []), ...(HEADERS.some(onScreen) ? ['header'] : [])];
    const got = await server.feed({ run, want, have: train ? plotsHave() : {},
                                    known: { ...known, header: headerKnown() } });
    if (!got || got.run !== run || got.error) return;
    put(got, train);
    if (!train) return;  // the look serves the Train tab only
    const now = document.querySelector('#train-looked [data-run]');
    if (now && now.dataset.run === run && got.state !== now.dataset.state) askLook();
    else if (onScreen('train-log') && got.version !== logVersion) { logVersion = got.version; askLook(); }
  } catch (e) {
    // the server is restarting or the connection dropped: the next tick asks again
  } finally {
    busy = false;
  }
}

// one loop per page, even if this runs again (the host mounted anew)
if (window.livetuneFeed) clearInterval(window.livetuneFeed);
window.livetuneFeed = setInterval(tick, EVERY_MS);
