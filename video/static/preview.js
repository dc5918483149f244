// The live preview page (served by video/preview.py): one card per stream, its latest JPEG on a
// canvas with each model's latest result drawn over it, its state, rates and answer age.
//
// Fed by /events (server-sent events, the whole board per event); a stream's JPEG is fetched
// from frame/<name>.jpg when its seq moves. Stream names and results are put in the page with
// textContent and canvas text only, never as HTML: a name may hold any printable character.
"use strict";

const COLOURS = { face: "#00ff00", landmark: "#ff00ff", text: "#00ffff", label: "#ffff00" };
const FIGURES_SHOWN = new Set(["state", "input_fps", "answered_fps", "age_ms_p50", "age_ms_p99"]);
const cards = new Map(); // stream name -> its card

function element(tag, className, parent) {
  const made = document.createElement(tag);
  if (className) made.className = className;
  if (parent) parent.appendChild(made);
  return made;
}

function cardFor(name) {
  let card = cards.get(name);
  if (card) return card;
  const root = element("section", "card", document.getElementById("streams"));
  const title = element("h2", "", root);
  const nameText = element("span", "name", title);
  nameText.textContent = name;
  card = {
    name,
    root,
    state: element("span", "state", title),
    canvas: element("canvas", "", root),
    figures: element("p", "figures", root),
    models: element("p", "models", root),
    image: null, // the decoded Image of seq `seq`
    seq: 0,
    loading: 0, // the seq being fetched, 0: none
    data: null,
  };
  card.canvas.width = 320;
  card.canvas.height = 180;
  const empty = document.getElementById("empty");
  if (empty) empty.remove();
  cards.set(name, card);
  return card;
}

function fmt(value, digits) {
  return typeof value === "number" ? value.toFixed(digits) : "–";
}

function flatten(prefix, value, out) {
  if (value !== null && typeof value === "object" && !Array.isArray(value)) {
    for (const [key, inner] of Object.entries(value)) flatten(prefix ? `${prefix}.${key}` : key, inner, out);
  } else {
    out.push(`${prefix} ${typeof value === "number" ? +value.toFixed(2) : String(value)}`);
  }
}

function showFigures(card, figures) {
  const state = typeof figures.state === "string" ? figures.state : "–";
  card.state.textContent = state;
  card.state.className = `state ${state.replace(/[^a-z]/g, "")}`;
  const lines = [
    `in ${fmt(figures.input_fps, 1)} fps · answered ${fmt(figures.answered_fps, 1)} fps · ` +
      `age p50 ${fmt(figures.age_ms_p50, 0)} ms · p99 ${fmt(figures.age_ms_p99, 0)} ms`,
  ];
  const rest = [];
  for (const [key, value] of Object.entries(figures)) {
    if (!FIGURES_SHOWN.has(key)) flatten(key, value, rest);
  }
  if (rest.length) lines.push(rest.join(" · "));
  card.figures.textContent = lines.join("\n");
}

function describe(result) {
  if (!result || typeof result !== "object") return "";
  const said = [];
  if (Array.isArray(result.faces)) said.push(`${result.faces.length} face(s)`);
  if (Array.isArray(result.lines)) said.push(result.lines.map((l) => JSON.stringify(String(l.text))).join(" ") || "no text");
  if (Array.isArray(result.top) && result.top.length) said.push(`${result.top[0].label} ${fmt(result.top[0].score, 2)}`);
  return said.join(" · ");
}

function showModels(card, stream) {
  const lines = [];
  const models = new Set([...Object.keys(stream.answers), ...Object.keys(stream.outcomes)]);
  for (const model of [...models].sort()) {
    const ok = stream.answers[model];
    const last = stream.outcomes[model];
    let line = `${model}: `;
    line += ok ? `frame ${ok.frame} · age ${fmt(ok.age_ms, 0)} ms · ${describe(ok.result)}` : "no result yet";
    if (last && last.outcome !== "OK") line += ` (frame ${last.frame}: ${last.outcome}${last.error ? " " + last.error : ""})`;
    lines.push(line);
  }
  const image = stream.image;
  if (image) lines.push(`image: frame ${image.frame ?? "–"}, ${image.width}×${image.height}`);
  card.models.textContent = lines.join("\n");
}

function isPoint(p) {
  return Array.isArray(p) && p.length >= 2 && Number.isFinite(p[0]) && Number.isFinite(p[1]);
}

function caption(ctx, text, x, y, colour) {
  ctx.font = "bold 14px sans-serif";
  const width = ctx.measureText(text).width + 6;
  ctx.fillStyle = "rgba(0, 0, 0, 0.7)";
  ctx.fillRect(x, y - 16, width, 18);
  ctx.fillStyle = colour;
  ctx.fillText(text, x + 3, y - 2);
}

// What a pipeline said of one face (docs/pipelines.md): its track, who it is (a gallery's
// name, docs/galleries.md) and its attributes.
function pipelineSaid(face) {
  const said = [];
  if (Number.isInteger(face.track_id)) said.push(`#${face.track_id}`);
  const identity = face.identity;
  if (identity && typeof identity.name === "string") said.push(identity.name);
  const attributes = face.attributes;
  if (attributes && typeof attributes.gender === "string") said.push(attributes.gender);
  if (attributes && Number.isFinite(attributes.age)) said.push(`${Math.round(attributes.age)}`);
  return said.join(" ");
}

function drawFaces(ctx, faces, s) {
  ctx.lineWidth = 3;
  ctx.strokeStyle = COLOURS.face;
  ctx.fillStyle = COLOURS.landmark;
  for (const face of faces) {
    const box = face && face.box;
    if (Array.isArray(box) && box.length === 4 && box.every(Number.isFinite)) {
      ctx.strokeRect(box[0] * s, box[1] * s, (box[2] - box[0]) * s, (box[3] - box[1]) * s);
      const said = pipelineSaid(face);
      if (said) caption(ctx, said, box[0] * s, box[1] * s, COLOURS.face);
    }
    for (const point of (face && face.landmarks) || []) {
      if (!isPoint(point)) continue;
      ctx.beginPath();
      ctx.arc(point[0] * s, point[1] * s, 3, 0, 2 * Math.PI);
      ctx.fill();
    }
  }
}

function drawLines(ctx, lines, s) {
  ctx.lineWidth = 2;
  for (const line of lines) {
    const quad = (line && line.box) || [];
    if (quad.length < 2 || !quad.every(isPoint)) continue;
    ctx.strokeStyle = COLOURS.text;
    ctx.beginPath();
    quad.forEach((p, i) => (i ? ctx.lineTo(p[0] * s, p[1] * s) : ctx.moveTo(p[0] * s, p[1] * s)));
    ctx.closePath();
    ctx.stroke();
    caption(ctx, String(line.text ?? ""), quad[0][0] * s, quad[0][1] * s, COLOURS.text);
  }
}

function draw(card) {
  const { canvas, image, data } = card;
  if (!image || !data || !data.image) return;
  if (canvas.width !== image.naturalWidth || canvas.height !== image.naturalHeight) {
    canvas.width = image.naturalWidth;
    canvas.height = image.naturalHeight;
  }
  const ctx = canvas.getContext("2d");
  ctx.drawImage(image, 0, 0);
  const s = image.naturalWidth / data.image.width; // results are in the source frame's pixels
  const labels = [];
  const drawn = [];
  for (const model of Object.keys(data.answers).sort()) {
    const result = data.answers[model].result;
    if (!result || typeof result !== "object") continue;
    drawn.push(model);
    if (Array.isArray(result.faces)) drawFaces(ctx, result.faces, s);
    if (Array.isArray(result.lines)) drawLines(ctx, result.lines, s);
    if (Array.isArray(result.top) && result.top.length) {
      labels.push(`${model}: ${result.top[0].label} ${fmt(result.top[0].score, 2)}`);
    }
  }
  labels.forEach((text, i) => caption(ctx, text, 4, canvas.height - 4 - 20 * (labels.length - 1 - i), COLOURS.label));
  // What the canvas shows now, for a reader of the page (the browser test waits on it).
  card.root.dataset.seq = String(card.seq);
  card.root.dataset.models = drawn.join(" ");
}

function fetchFrame(card, seq) {
  card.loading = seq;
  const image = new Image();
  image.onload = () => {
    card.loading = 0;
    if (seq > card.seq) {
      card.image = image;
      card.seq = seq;
    }
    draw(card);
    if (card.data && card.data.image && card.data.image.seq > card.seq) fetchFrame(card, card.data.image.seq);
  };
  image.onerror = () => {
    card.loading = 0;
  };
  image.src = `frame/${encodeURIComponent(card.name)}.jpg?seq=${seq}`;
}

function update(stream) {
  const card = cardFor(String(stream.name));
  card.data = stream;
  showFigures(card, stream.figures || {});
  showModels(card, stream);
  const image = stream.image;
  if (image && image.seq > card.seq && !card.loading) fetchFrame(card, image.seq);
  else draw(card);
}

function connect() {
  const status = document.getElementById("connection");
  const events = new EventSource("events");
  events.onopen = () => (status.textContent = "live");
  events.onerror = () => (status.textContent = "reconnecting…"); // EventSource retries by itself
  events.onmessage = (event) => {
    const board = JSON.parse(event.data);
    for (const stream of board.streams) update(stream);
    document.body.dataset.version = String(board.version);
  };
}

connect();
