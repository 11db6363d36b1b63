// itmatch search page: query -> result grid; click a result -> per-word attention heatmaps drawn on
// canvases from /api/explain's numbers (SCAN Fig. 4 style). No dependencies.
// The URL holds the view (?q=...&id=...): a link to an explanation opens it. Image ids are file names
// escaped by the server (docs/search.md) and are only ever written as text (textContent), never as markup.
"use strict";

const $ = (sel) => document.querySelector(sel);
// The query whose results are shown (explain asks about it): set when they are drawn, not when it is sent.
let lastQuery = "";
// Searches sent so far: an answer to any but the latest is dropped, since a slow search answered after a newer,
// faster one would otherwise replace the newer results under the newer query.
let searches = 0;
// Whether the index's model has per-word attention maps (/health's "explain"): a VSE++, MMCA or SMAN model has
// none, so its results open nothing and the page says why once, instead of an error on every click. Results are
// drawn only once it is known (modelReady, below): a search typed before /health answers waits for it.
let canExplain = true;
// Whether several models score each photo (/health's "models": an ensemble, `--ensemble`).
let ensemble = false;

function setStatus(text) { $("#status").textContent = text || ""; }

async function getJSON(url, options) {
  const response = await fetch(url, options);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) {
    const err = body.error || {};
    throw new Error((err.message || response.statusText) + (err.hint ? " (" + err.hint + ")" : ""));
  }
  return body;
}

async function search(query, k) {
  const mine = ++searches;
  $("#explain").hidden = true;
  $("#captions").hidden = true;
  renderUnknownWords([]);
  setStatus("searching…");
  try {
    const data = await getJSON("/api/search?q=" + encodeURIComponent(query) + "&k=" + k);
    await modelReady;
    if (mine !== searches) return;  // out of date: a newer search was sent meanwhile
    lastQuery = query;
    renderResults(data.results);
    renderUnknownWords(data.unknown_words || []);
    setStatus(data.results.length + " results in " + data.took_ms + " ms");
  } catch (e) {
    if (mine !== searches) return;
    $("#results").replaceChildren();
    setStatus(e.message);
  }
}

// The query's words the model does not know: it reads each as <unk>, so the ranking ignores their meaning.
function renderUnknownWords(words) {
  const box = $("#unknown-words");
  box.replaceChildren();
  box.hidden = words.length === 0;
  if (box.hidden) return;
  box.append("Not in the model's vocabulary (read as <unk>, meaning lost): ");
  for (const w of words) {
    const mark = document.createElement("mark");
    mark.className = "unknown-word";
    mark.textContent = w;
    box.append(mark, " ");
  }
}

function renderResults(results) {
  const grid = $("#results");
  grid.replaceChildren();
  for (const hit of results) {
    const card = document.createElement("div");
    card.className = "result";
    card.dataset.id = hit.id;
    const img = document.createElement("img");
    img.src = hit.url;
    img.alt = hit.id;
    img.loading = "lazy";
    // a photo deleted or moved since indexing is still ranked (its encoding is in the index): say so in its place
    img.addEventListener("error", () => img.replaceWith(missingPhoto()), { once: true });
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.innerHTML = '<span class="rank"></span><span class="id"></span><span class="score"></span>';
    meta.querySelector(".rank").textContent = "#" + hit.rank;
    meta.querySelector(".id").textContent = hit.id;
    meta.querySelector(".id").title = hit.id;  // the whole name on hover when it is cut short
    meta.querySelector(".score").textContent = hit.score.toFixed(3);
    card.append(img, meta);
    if (canExplain) {
      card.tabIndex = 0;  // a stop of the keyboard's tour; a card with nothing to open is none
      card.addEventListener("click", () => explain(hit.id));
      card.addEventListener("keydown", (ev) => { if (ev.key === "Enter") explain(hit.id); });
    } else {
      card.classList.add("no-explain");
    }
    grid.append(card);
  }
}

function missingPhoto() {
  const box = document.createElement("div");
  box.className = "missing-photo";
  box.textContent = "photo not available (deleted or moved since it was indexed)";
  return box;
}

// A perceptual-ish blue -> cyan -> yellow -> red ramp for weights scaled to 0..1.
function colour(t) {
  const stops = [[0, 0, 80], [0, 150, 255], [255, 230, 0], [230, 20, 20]];
  const x = Math.min(0.9999, Math.max(0, t)) * (stops.length - 1);
  const i = Math.floor(x), f = x - i;
  return stops[i].map((c, j) => Math.round(c + f * (stops[i + 1][j] - c)));
}

// The whole photo at its own aspect ratio, the grid stretched over it: the model saw the whole photo
// (squashed to a square), so grid cell (r, c) covers the same share of the photo either way, and the
// heatmaps show exactly the pixels of the photo shown above them.
function drawHeatmap(canvas, photo, weights) {
  const rows = weights.length, cols = weights[0].length;
  const longest = 300, aspect = photo.naturalWidth / photo.naturalHeight;
  canvas.width = aspect >= 1 ? longest : Math.round(longest * aspect);
  canvas.height = aspect >= 1 ? Math.round(longest / aspect) : longest;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(photo, 0, 0, canvas.width, canvas.height);
  let max = 0;
  for (const row of weights) for (const w of row) max = Math.max(max, w);
  const small = document.createElement("canvas");
  small.width = cols; small.height = rows;
  const sctx = small.getContext("2d");
  const pixels = sctx.createImageData(cols, rows);
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < cols; c++) {
      const t = max > 0 ? weights[r][c] / max : 0;
      const [R, G, B] = colour(t);
      const o = 4 * (r * cols + c);
      pixels.data[o] = R; pixels.data[o + 1] = G; pixels.data[o + 2] = B;
      pixels.data[o + 3] = Math.round(60 + 150 * t);
    }
  }
  sctx.putImageData(pixels, 0, 0);
  ctx.imageSmoothingEnabled = true;  // bilinear upsampling of the grid, as in SCAN's figures
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(small, 0, 0, canvas.width, canvas.height);
}

// The page's URL says what it shows: ?q= the query, &id= the explained photo (a link to share).
function setLocation(query, id) {
  const url = new URL(location.href);
  url.searchParams.set("q", query);
  if (id) url.searchParams.set("id", id); else url.searchParams.delete("id");
  history.replaceState(null, "", url);
}

async function explain(id) {
  document.querySelectorAll(".result.selected").forEach((el) => el.classList.remove("selected"));
  const card = [...document.querySelectorAll(".result")].find((el) => el.dataset.id === id);
  if (card) card.classList.add("selected");
  setStatus("computing attention…");
  try {
    const data = await getJSON("/api/explain?q=" + encodeURIComponent(lastQuery) + "&id=" + encodeURIComponent(id));
    const photo = new Image();
    photo.src = data.url;
    await photo.decode();
    $("#explain-photo").src = data.url;
    // (an ensemble draws one of its models' attention: the score beside it is that model's, not the ranking's)
    const whose = ensemble ? data.model + "\u2019s score " : "score ";
    $("#explain-title").textContent = "\u201c" + data.query + "\u201d \u2014 " + data.id + " (" + whose + data.score.toFixed(3) + ")";
    const maps = $("#word-maps");
    maps.replaceChildren();
    for (const w of data.words) {
      const box = document.createElement("div");
      box.className = "word-map" + (w.known ? "" : " unknown");
      const canvas = document.createElement("canvas");
      drawHeatmap(canvas, photo, w.weights);
      const label = document.createElement("div");
      label.className = "word";
      label.textContent = w.word + (w.known ? "" : " (unknown)");
      box.append(canvas, label);
      maps.append(box);
    }
    $("#explain").hidden = false;
    $("#explain").dataset.id = data.id;
    setLocation(lastQuery, data.id);
    $("#explain").scrollIntoView({ behavior: "smooth", block: "start" });
    setStatus("");
  } catch (e) {
    setStatus(e.message);
  }
}

async function searchByPhoto(file) {
  setStatus("finding captions…");
  try {
    const data = await getJSON("/api/search/image?k=" + $("#k").value, {
      method: "POST", body: file, headers: { "Content-Type": file.type || "application/octet-stream" },
    });
    const list = document.createElement("ol");
    for (const r of data.results) {
      const li = document.createElement("li");
      li.textContent = r.caption + "  (" + r.score.toFixed(3) + ")";
      if (r.unknown_words && r.unknown_words.length) {
        const note = document.createElement("span");
        note.className = "unknown-note";
        note.textContent = " unknown: " + r.unknown_words.join(", ");
        li.append(note);
      }
      list.append(li);
    }
    const parts = [list];
    if (data.captions_without_known_word) {
      const note = document.createElement("p");
      note.className = "unknown-note";
      note.textContent = data.captions_without_known_word + " caption(s) have no word the model knows and are not ranked.";
      parts.push(note);
    }
    $("#captions").replaceChildren(...parts);
    $("#captions").hidden = false;
    setStatus("");
  } catch (e) {
    setStatus(e.message);
  }
}

$("#search-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const query = $("#q").value.trim();
  setLocation(query, null);
  search(query, $("#k").value);
});
$("#explain-close").addEventListener("click", () => {
  $("#explain").hidden = true;
  setLocation(lastQuery, null);
});
$("#photo").addEventListener("change", (ev) => { if (ev.target.files[0]) searchByPhoto(ev.target.files[0]); });

async function readModel() {
  try {
    const health = await getJSON("/health");
    canExplain = health.explain !== false;
    ensemble = (health.models || []).length > 1;
    const note = $("#model-note");
    note.hidden = canExplain;
    if (!canExplain) note.textContent = health.explain_note;  // (the server's wording: also in its log)
  } catch (e) {
    // (results stay clickable: explain answers for itself)
    setStatus("could not read the index's model from /health: " + e.message);
  }
}
const modelReady = readModel();

async function openFromLocation() {
  const params = new URL(location.href).searchParams;
  const query = params.get("q"), id = params.get("id");
  if (!query) return;
  $("#q").value = query;
  await search(query, $("#k").value);
  if (!id || lastQuery !== query) return;  // (no results drawn: the search's error stays on the page)
  if (canExplain) await explain(id);  // the photo need not be among the results
  else setLocation(query, null);  // a link that promises a map this model cannot draw is not kept
}
openFromLocation();
