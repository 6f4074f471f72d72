// The cosystream playground: speak through WS /v1/tts/stream with gap-free playback, register voices,
// and see where the first audio's time goes. Talks only to the server that served it.
//
// window.playground holds the page's state as plain data (read by the browser tests, and handy in the
// console): what was received and scheduled, the timings, the server's done event, underruns, errors.

import { PcmPlayer, SAMPLE_RATE, pcm16ToFloat } from "./player.js";
import { Waveform } from "./waveform.js";
import { decodeToMono, wavFromFloat, wavFromInt16 } from "./wav.js";

const $ = (id) => document.getElementById(id);
const MAX_TOKEN_RATE = 90;              // the server allows 100 WebSocket messages per second
const CANCEL_CHECK_S = 5;               // how long Stop waits for the server's record of the request
const WORD_END = /^[\s\S]*[\s.,!?;:\u3001\u3002\uff0c\uff01\uff1f\uff1b\uff1a]/;
// LLM-like tokens: a CJK character, or up to four other characters, with the white space before them
const LLM_TOKEN = /\s*(?:[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|[^\s\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]{1,4})\s*/gu;

const pg = {
  server: "unknown",      // ready | warming | dead | offline | unknown
  needsKey: false,
  voices: [],             // registered voices as GET /v1/voices lists them
  speakers: [],           // built-in speakers (GET /v1/speakers)
  voiceMessage: null,     // the last voice registration/deletion outcome
  voiceError: null,       // the last server error of the voice form: {code, message, field}
};
window.playground = pg;
resetRun(null);

let apiKey = "";           // only in this page's memory
let ws = null;
let liveSent = "";         // live text already sent
let liveLastValue = "";
let writeTimer = null;
let pcmPieces = [];        // Int16Array per chunk, for the wav download
let carry = null;          // an odd byte split across frames
let animating = false;
let recording = null;      // {blob, filename, duration}
let recorder = null;
let readyTimer = null;
let starting = false;      // between Speak and the socket's creation (the audio context resumes)

const player = new PcmPlayer();
const wave = new Waveform($("wave"), SAMPLE_RATE);

// ------------------------------------------------------------------ API

function authHeaders() {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

/** fetch with the key; resolves to {ok, status, data, error} where error is the server's error detail. */
async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  } catch (exc) {
    return { ok: false, status: 0, error: { code: "network", message: `cannot reach the server (${exc.message})`, field: null } };
  }
  let data = null;
  if (response.status !== 204) {
    const text = await response.text();
    try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  }
  if (response.status === 401) askForKey(data && data.error);
  if (!response.ok) {
    const error = (data && data.error) || { code: `http_${response.status}`, message: String(data || response.statusText), field: null };
    return { ok: false, status: response.status, data, error };
  }
  return { ok: true, status: response.status, data, error: null };
}

function wsUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const query = apiKey ? `?api_key=${encodeURIComponent(apiKey)}` : "";
  return `${scheme}//${location.host}/v1/tts/stream${query}`;
}

// ------------------------------------------------------------------ server state, key, voices

async function pollReady() {
  clearTimeout(readyTimer);
  readyTimer = null;
  const result = await api("/ready");
  let state;
  if (result.ok) state = "ready";
  else if (result.status === 0) state = "offline";
  else if (result.error.code === "not_ready") state = "warming";
  else if (result.error.code === "engine_dead") state = "dead";
  else if (result.status === 401) state = "locked";
  else state = "unknown";
  setServerState(state);
  if (state !== "ready" && state !== "dead") readyTimer = setTimeout(pollReady, 2000);
}

function setServerState(state) {
  pg.server = state;
  const labels = { ready: "ready", warming: "warming up…", dead: "engine stopped: restart the server",
    offline: "server unreachable", locked: "needs an API key", unknown: "connecting…" };
  $("server-state").dataset.state = state;
  $("server-state-text").textContent = labels[state] || state;
}

function askForKey(error) {
  pg.needsKey = true;
  $("keybar").hidden = false;
  if (apiKey && error) showErrors($("key-form"), error);
}

async function loadVoices() {
  const [voices, speakers] = await Promise.all([api("/v1/voices"), api("/v1/speakers")]);
  if (!voices.ok) return;
  pg.needsKey = false;
  $("keybar").hidden = true;
  clearErrors($("key-form"));
  pg.voices = voices.data.voices;
  pg.speakers = speakers.ok ? speakers.data.speakers : [];
  renderVoiceOptions();
  renderVoiceList();
}

function renderVoiceOptions() {
  const select = $("voice");
  const previous = select.value;
  select.replaceChildren();
  for (const v of pg.voices) {
    select.append(new Option(`${v.name} · ${v.prompt_seconds.toFixed(1)} s${v.prompt_text ? "" : " · no transcript"}`, v.name));
  }
  const builtIn = pg.speakers.filter((s) => s.zero_shot);
  if (builtIn.length) {
    const group = document.createElement("optgroup");
    group.label = "Built-in";
    for (const s of builtIn) group.append(new Option(s.name, s.name));
    select.append(group);
  }
  if (!select.options.length) {
    const none = new Option("no voices yet: register one", "");
    none.disabled = true;
    select.append(none);
  }
  if ([...select.options].some((o) => o.value === previous)) select.value = previous;

  const speakerSelect = $("sft-speaker");
  speakerSelect.replaceChildren(...pg.speakers.map((s) => new Option(s.name, s.name)));
  const sft = $("mode").querySelector('option[value="sft"]');
  sft.disabled = pg.speakers.length === 0;
  sft.textContent = pg.speakers.length ? "Built-in speaker" : "Built-in speaker (this model has none)";
  if (sft.disabled && $("mode").value === "sft") $("mode").value = "zero_shot";
  $("voice-count").textContent = pg.voices.length === 1 ? "1 registered" : `${pg.voices.length} registered`;
  updateModeFields();
}

function renderVoiceList() {
  const list = $("voice-list");
  list.replaceChildren();
  for (const v of pg.voices) {
    const item = document.createElement("li");
    item.dataset.voice = v.name;
    const info = document.createElement("div");
    info.className = "voice-info";
    const name = document.createElement("span");
    name.className = "voice-name";
    name.textContent = v.name;
    const meta = document.createElement("span");
    meta.className = "voice-meta";
    meta.textContent = `${v.prompt_seconds.toFixed(1)} s · ${v.num_prompt_tokens} tokens`;
    const text = document.createElement("span");
    text.className = "voice-text";
    text.textContent = v.prompt_text ? `“${v.prompt_text}”` : "no transcript: cross-lingual and instruct only";
    info.append(name, meta, text);
    const use = button("Use", "btn small", () => { $("voice").value = v.name; if ($("mode").value === "sft") $("mode").value = "zero_shot"; updateModeFields(); });
    const del = button("Delete", "btn small danger-outline", () => deleteVoice(v.name, del));
    del.dataset.action = "delete";
    item.append(info, use, del);
    list.append(item);
  }
}

function button(label, className, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

async function deleteVoice(name, btn) {
  if (btn.dataset.confirm !== "1") {   // two clicks: a voice's analysis is lost with it
    btn.dataset.confirm = "1";
    btn.textContent = "Really delete?";
    setTimeout(() => { btn.dataset.confirm = ""; btn.textContent = "Delete"; }, 4000);
    return;
  }
  const result = await api(`/v1/voices/${encodeURIComponent(name)}`, { method: "DELETE" });
  if (result.ok) {
    pg.voiceMessage = `deleted ${name}`;
    setStatus("voice-status", `Deleted ${name}.`);
  } else {
    pg.voiceError = result.error;
    setStatus("voice-status", result.error.message, "error");
  }
  await loadVoices();
}

// ------------------------------------------------------------------ errors next to their fields

function clearErrors(form) {
  for (const el of form.querySelectorAll(".field-error")) el.textContent = "";
  for (const el of form.querySelectorAll(".has-error")) el.classList.remove("has-error");
}

/** Put the server's message next to the field it names (the general slot when none matches). */
function showErrors(form, error) {
  const field = error.field || "";
  let slot = field ? form.querySelector(`.field-error[data-error-for="${CSS.escape(field)}"]`) : null;
  if (!slot) slot = form.querySelector('.field-error[data-error-for=""]');
  slot.textContent = error.message;
  const details = slot.closest("details");
  if (details) details.open = true;      // an error inside the closed Advanced section must be seen
  const input = slot.closest(".field")?.querySelector("input, select, textarea");
  if (input) input.classList.add("has-error");
}

// ------------------------------------------------------------------ mode fields

function updateModeFields() {
  const mode = $("mode").value;
  $("instruct-field").hidden = mode !== "instruct2";
  $("speaker-field").hidden = mode !== "sft";
  $("voice-field").hidden = mode === "sft";
}

function startOptions() {
  const mode = $("mode").value;
  const options = { type: "start", mode, response_format: "pcm" };
  if (mode === "sft") options.sft_speaker = $("sft-speaker").value;
  else options.voice = $("voice").value;
  if (mode === "instruct2") options.instruct_text = $("instruct").value;
  for (const [id, key, parse] of [["seed", "seed", parseInt], ["first-hop", "first_hop", parseInt],
    ["top-k", "top_k", parseInt], ["top-p", "top_p", parseFloat], ["force-tokens", "force_tokens", parseInt]]) {
    const raw = $(id).value.trim();
    if (raw !== "") options[key] = parse(raw, 10);
  }
  return options;
}

/** What the page can tell before asking the server; null when nothing is missing. */
function localProblem(options) {
  if (options.mode === "sft" && !options.sft_speaker) return { field: "sft_speaker", message: "sft_speaker: this model has no built-in speakers" };
  if (options.mode !== "sft" && !options.voice) return { field: "voice", message: "voice: register a voice first (below)" };
  for (const key of ["seed", "first_hop", "top_k", "top_p", "force_tokens"]) {
    if (key in options && !Number.isFinite(options[key])) return { field: key, message: `${key}: not a number` };
  }
  return null;
}

// ------------------------------------------------------------------ one request

function resetRun(kind) {
  Object.assign(pg, {
    kind,                   // "speak" | "live" | null
    status: "idle",         // idle | connecting | streaming | playing | finished | stopped | error
    requestId: null,
    startedAt: null,        // performance.now() when Speak was pressed (speak) or the first text was sent (live)
    chunks: 0,              // binary audio frames received
    chunkEvents: 0,         // chunk events received
    bytes: 0,
    receivedSeconds: 0,
    scheduledSeconds: 0,
    playedSeconds: 0,
    firstAudioMs: null,     // startedAt → first PCM bytes in the page
    leadMs: null,           // first PCM bytes → their scheduled playback (the page's buffering)
    leadParts: null,
    playbackStartMs: null,  // startedAt → scheduled playback start
    firstScheduledAt: null, // performance.now() when the first chunk was handed to the audio clock
    doneAt: null,           // performance.now() when the done event arrived
    underruns: [],          // {atS: audio position, gapMs}: chunks that came after the audio ran dry
    schedule: [],           // {ctxStart, audioStart, duration} per chunk, on the AudioContext clock
    waveSamples: 0,         // samples drawn on the waveform
    done: null,             // the server's done event
    error: null,            // {code, message, field}
    closeCode: null,
    serverOutcome: null,    // after Stop: the outcome GET /v1/requests/{id} reports
    serverRecord: null,     // after Stop: that record (the server's timings of the stopped request)
    piecesSent: 0,
    textSent: "",
    endSent: false,
  });
}

async function startRun(kind) {
  if (ws || starting) return;
  const form = $("speak-form");
  clearErrors(form);
  const options = startOptions();
  const problem = localProblem(options);
  if (problem) { showErrors(form, problem); return; }
  const text = $("text").value;
  if (kind === "speak") {
    if (!text.trim()) { showErrors(form, { field: "text", message: "text: empty" }); return; }
    options.text = text;
  }
  const clickedAt = performance.now();
  resetRun(kind);
  pg.status = "connecting";
  starting = true;
  try {
    await player.ensureContext();      // inside the click: browsers allow audio to start from a gesture
  } finally {
    starting = false;
  }
  player.reset(Math.max(0, Number($("extra-buffer").value) || 0) / 1000);
  wave.clear();
  pcmPieces = [];
  carry = null;
  liveSent = "";
  liveLastValue = $("text").value;
  renderMetrics();
  renderStages();
  if (kind === "speak") pg.startedAt = clickedAt;
  setRunning(true);
  setStatus("speak-status", "Connecting…");

  ws = new WebSocket(wsUrl());
  ws.binaryType = "arraybuffer";
  const socket = ws;
  socket.onopen = () => {
    socket.send(JSON.stringify(options));
    if (kind === "speak") { socket.send(JSON.stringify({ type: "end" })); pg.endSent = true; }
    pg.status = "streaming";
    setStatus("speak-status", kind === "speak" ? "Synthesising…" : "Live: type, and each finished word is sent.");
    if (kind === "live") { $("text").focus(); flushLiveText(false); }
  };
  socket.onmessage = (event) => {
    const arrivedAt = performance.now();
    if (typeof event.data === "string") onServerEvent(JSON.parse(event.data));
    else onAudio(new Uint8Array(event.data), arrivedAt);
  };
  socket.onclose = (event) => onClose(socket, event);
}

function onAudio(bytes, arrivedAt) {
  if (player.stopped) return;
  if (carry) {
    const joined = new Uint8Array(carry.length + bytes.length);
    joined.set(carry);
    joined.set(bytes, carry.length);
    bytes = joined;
  }
  const { samples, ints, rest } = pcm16ToFloat(bytes);
  carry = rest;
  player.push(samples, arrivedAt);   // schedule first: everything below is bookkeeping
  if (pg.firstScheduledAt === null) pg.firstScheduledAt = performance.now();
  if (pg.firstAudioMs === null) pg.firstAudioMs = arrivedAt - (pg.startedAt ?? arrivedAt);
  if (pg.leadMs === null && player.leadMs !== null) {
    pg.leadMs = player.leadMs;
    pg.leadParts = player.leadParts;
    pg.playbackStartMs = player.playsAt - (pg.startedAt ?? arrivedAt);
  }
  pcmPieces.push(ints.slice());
  pg.chunks += 1;
  pg.bytes += bytes.length;
  pg.receivedSeconds = player.scheduledSeconds;
  pg.scheduledSeconds = player.scheduledSeconds;
  pg.underruns = player.underruns.map((u) => ({ ...u }));
  pg.schedule = player.segments.map((seg) => ({ ...seg }));
  wave.addChunk(samples);
  pg.waveSamples = wave.numSamples;
  wave.setUnderruns(pg.underruns);
  $("download-btn").disabled = false;
  if (pg.status === "streaming") setStatus("speak-status", "Playing while the rest is synthesised…");
  renderMetrics();
  animate();
}

function onServerEvent(event) {
  if (event.type === "started") {
    pg.requestId = event.request_id;
    $("request-id").textContent = event.request_id;
  } else if (event.type === "chunk") {
    pg.chunkEvents += 1;
  } else if (event.type === "done") {
    pg.doneAt = performance.now();
    pg.done = event;
    renderMetrics();
    renderStages();
  } else if (event.type === "error") {
    pg.error = event.error;
    showErrors($("speak-form"), event.error);
  }
}

function onClose(socket, event) {
  if (socket !== ws) return;
  ws = null;
  stopWriting();
  pg.closeCode = event.code;
  if (pg.status === "stopped") {
    // Stop already reported
  } else if (pg.error) {
    pg.status = "error";
    player.stop();
    setStatus("speak-status", `Failed: ${pg.error.code}`, "error");
  } else if (!pg.done) {
    pg.status = "error";
    pg.error = { code: "closed", message: `the connection closed (code ${event.code}) before the audio was done`, field: null };
    showErrors($("speak-form"), pg.error);
    player.stop();
    setStatus("speak-status", "Connection lost.", "error");
  } else {
    pg.status = player.isPlaying ? "playing" : "finished";
    setStatus("speak-status", pg.status === "playing" ? "All audio received; playing." : "Done.");
  }
  setRunning(false);
  renderMetrics();
  animate();
}

async function stop() {
  const socket = ws;
  const requestId = pg.requestId;
  const inFlight = socket !== null && !pg.done;
  player.stop();
  stopWriting();
  if (pg.status === "idle") return;
  pg.status = "stopped";
  if (socket) {
    ws = null;
    socket.close(1000, "stopped");   // closing the socket cancels the request in the engine
  }
  setRunning(false);
  renderMetrics();
  if (!inFlight) { setStatus("speak-status", "Stopped playback."); return; }
  if (!requestId) { setStatus("speak-status", "Stopped before the server started the request."); return; }
  setStatus("speak-status", `Stopped. Asking the server about ${requestId}…`);
  pg.serverRecord = await finishedRecord(requestId);
  pg.serverOutcome = pg.serverRecord ? pg.serverRecord.outcome : null;
  renderMetrics();
  const outcome = pg.serverOutcome;
  setStatus("speak-status", outcome
    ? `Stopped. The server ended ${requestId} as “${outcome}”.`
    : `Stopped. The server has no record of ${requestId} yet.`, outcome === "cancelled" ? "" : "error");
}

/** What the server recorded for a finished request (it answers 404 while the request still runs). */
async function finishedRecord(requestId) {
  const deadline = performance.now() + CANCEL_CHECK_S * 1000;
  while (performance.now() < deadline) {
    const result = await api(`/v1/requests/${encodeURIComponent(requestId)}`);
    if (result.ok) return result.data;
    if (result.status !== 404) return null;
    await new Promise((r) => setTimeout(r, 150));
  }
  return null;
}

function setRunning(running) {
  const live = pg.kind === "live" && running;
  $("speak-btn").disabled = running;
  $("live-btn").disabled = running;
  $("finish-btn").disabled = !live || pg.endSent;
  $("write-btn").disabled = running && (pg.kind !== "live" || writeTimer !== null || pg.endSent);
  $("stop-btn").disabled = !running && !player.isPlaying;
  $("text").readOnly = running && (pg.kind === "speak" || pg.endSent || writeTimer !== null);
}

// ------------------------------------------------------------------ live text

function sendPiece(piece) {
  if (!ws || ws.readyState !== WebSocket.OPEN || !piece) return;
  if (pg.startedAt === null) pg.startedAt = performance.now();
  ws.send(JSON.stringify({ type: "text", text: piece }));
  pg.piecesSent += 1;
  pg.textSent += piece;
  liveSent += piece;
  setStatus("speak-status", `Live: ${pg.piecesSent} pieces, ${pg.textSent.length} characters sent.`);
}

/** Send the finished words typed since the last piece (everything with `all`). */
function flushLiveText(all) {
  const textarea = $("text");
  if (!textarea.value.startsWith(liveSent)) {
    textarea.value = liveLastValue;   // sent text is spoken already: it cannot be changed
    setStatus("speak-status", "Text already sent cannot be edited; type after it.", "error");
  }
  liveLastValue = textarea.value;
  const pending = textarea.value.slice(liveSent.length);
  const piece = all ? pending : (pending.match(WORD_END) || [""])[0];
  if (piece) sendPiece(piece);
}

function finishLive() {
  if (!ws || pg.endSent) return;
  flushLiveText(true);
  ws.send(JSON.stringify({ type: "end" }));
  pg.endSent = true;
  setRunning(true);
}

/** Stream the box's text token by token at the chosen rate, as an LLM writing it would. */
async function writeAtRate() {
  const source = $("text").value;
  if (!source.trim()) { showErrors($("speak-form"), { field: "text", message: "text: empty" }); return; }
  const rate = Math.min(MAX_TOKEN_RATE, Math.max(1, Number($("token-rate").value) || 15));
  if (!ws) {
    await startRun("live");
    if (!ws) return;
  }
  const tokens = source.slice(liveSent.length).match(LLM_TOKEN) || [];
  $("text").value = liveSent;
  liveLastValue = liveSent;
  let i = 0;
  const tick = () => {
    if (!ws) { writeTimer = null; return; }
    if (ws.readyState === WebSocket.CONNECTING) { writeTimer = setTimeout(tick, 20); return; }
    if (i >= tokens.length) { writeTimer = null; finishLive(); return; }
    $("text").value += tokens[i];
    liveLastValue = $("text").value;
    sendPiece(tokens[i]);
    i += 1;
    writeTimer = setTimeout(tick, 1000 / rate);
  };
  writeTimer = setTimeout(tick, 0);
  setRunning(true);
}

function stopWriting() {
  if (writeTimer !== null) clearTimeout(writeTimer);
  writeTimer = null;
}

function selectTab(kind) {
  const live = kind === "live";
  $("tab-whole").setAttribute("aria-selected", String(!live));
  $("tab-live").setAttribute("aria-selected", String(live));
  $("speak-btn").hidden = live;
  $("live-btn").hidden = !live;
  $("finish-btn").hidden = !live;
  $("llm-rate").hidden = !live;
  $("live-note").hidden = !live;
}

// ------------------------------------------------------------------ speed display

function fmtMs(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "–";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

function renderMetrics() {
  $("m-first-audio").textContent = fmtMs(pg.firstAudioMs);
  $("m-lead").textContent = fmtMs(pg.leadMs);
  const serverFirst = (pg.done || pg.serverRecord || {}).server_first_audio_s ?? null;
  $("m-server-first").textContent = serverFirst === null || serverFirst === undefined ? "–" : fmtMs(serverFirst * 1000);
  const rtf = pg.done && pg.done.times.rtf !== null ? `RTF ${pg.done.times.rtf.toFixed(2)} · ` : "";
  $("m-audio").textContent = pg.receivedSeconds ? `${pg.receivedSeconds.toFixed(2)} s` : "–";
  const n = pg.underruns.length;
  const note = $("m-underruns");
  note.textContent = rtf + (n === 0 ? "no underruns" : `${n} underrun${n > 1 ? "s" : ""}, ${Math.round(pg.underruns.reduce((s, u) => s + u.gapMs, 0))} ms silent`);
  note.classList.toggle("bad", n > 0);
  if (!pg.requestId) $("request-id").textContent = "";
}

const STAGES = [
  ["queue_s", "Queue", "submitted → admitted to the LM", "span"],
  ["frontend_s", "Text & prompt frontend", "text normalisation, tokens, prompt features", "span"],
  ["llm_prefill_s", "LM prefill", "", "span"],
  ["first_token_s", "First speech token", "admitted → first token", "mark"],
  ["first_chunk_ready_s", "First chunk's tokens", "submitted → all its tokens there", "mark"],
  ["first_chunk_start_s", "First chunk to the flow", "submitted → handed to token-to-wave", "mark"],
  ["first_chunk_flow_s", "Flow, first chunk", "", "span"],
  ["first_chunk_vocoder_s", "Vocoder, first chunk", "", "span"],
  ["first_audio_s", "Engine first audio", "submitted → first chunk ready", "mark"],
];

function renderStages() {
  const box = $("stages");
  box.replaceChildren();
  if (!pg.done) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = pg.status === "idle" ? "Speak to see where the first audio's time goes." : "Waiting for the done event…";
    box.append(empty);
    return;
  }
  const times = pg.done.times;
  const rows = STAGES.map(([key, label, note, kind]) => [label, times[key], note, kind]);
  rows.push(["Server first audio", pg.done.server_first_audio_s, "arrival → first bytes sent", "mark"]);
  if (pg.firstAudioMs !== null) rows.push(["This browser's first audio", pg.firstAudioMs / 1000, pg.kind === "live" ? "first text sent → first bytes here" : "Speak → first bytes here", "mark"]);
  const known = new Set([...STAGES.map((s) => s[0]), "total_s", "num_tokens", "audio_s", "rtf"]);
  for (const [key, value] of Object.entries(times)) {
    if (!known.has(key) && typeof value === "number") rows.push([key, value, "", "span"]);
  }
  const scale = Math.max(...rows.map((r) => r[1] || 0), 1e-6);
  for (const [label, value, note, kind] of rows) {
    if (value === null || value === undefined) continue;
    const row = document.createElement("div");
    row.className = `stage ${kind}`;
    row.title = note;
    const name = document.createElement("span");
    name.className = "stage-name";
    name.textContent = label;
    const track = document.createElement("span");
    track.className = "stage-track";
    const bar = document.createElement("span");
    bar.className = "stage-bar";
    bar.style.width = `${Math.max(0.5, (100 * value) / scale)}%`;
    track.append(bar);
    const val = document.createElement("span");
    val.className = "stage-value";
    val.textContent = fmtMs(value * 1000);
    row.append(name, track, val);
    box.append(row);
  }
  const total = document.createElement("p");
  total.className = "stage-total";
  total.textContent = `Engine total ${fmtMs(times.total_s * 1000)} for ${times.audio_s.toFixed(2)} s of audio `
    + `(${times.num_tokens} speech tokens, ${pg.done.num_chunks} chunks)`;
  box.append(total);
}

function animate() {
  if (animating) return;
  animating = true;
  const frame = () => {
    const played = player.playedSeconds();
    if (played !== null) {
      pg.playedSeconds = played;
      wave.setPlayed(played);
    }
    if (!ws && !player.isPlaying) {
      animating = false;
      if (pg.status === "playing") {
        pg.status = "finished";
        setStatus("speak-status", "Done.");
      }
      setRunning(false);
      return;
    }
    requestAnimationFrame(frame);
  };
  requestAnimationFrame(frame);
}

function downloadWav() {
  if (!pcmPieces.length) return;
  const blob = wavFromInt16(pcmPieces, SAMPLE_RATE);
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = `${pg.requestId || "cosystream"}.wav`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

function setStatus(id, text, kind = "") {
  const el = $(id);
  el.textContent = text;
  el.classList.toggle("error", kind === "error");
}

// ------------------------------------------------------------------ voice registration

async function useRecording(blob, filename, label) {
  const ctx = await player.ensureContext();
  const decoded = await decodeToMono(ctx, blob);
  recording = { blob, filename, duration: decoded ? decoded.duration : null };
  pg.recordingSeconds = recording.duration;
  const preview = $("voice-preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  preview.src = URL.createObjectURL(blob);
  preview.hidden = false;
  $("rec-info").textContent = decoded
    ? `${label} · ${decoded.duration.toFixed(1)} s`
    : `${label} · duration unknown (this browser cannot decode it; the server will check it)`;
  $("rec-info").classList.toggle("warn", Boolean(decoded && (decoded.duration < 3 || decoded.duration > 10)));
}

async function toggleRecording() {
  if (recorder) { recorder.stop(); return; }
  clearErrors($("voice-form"));
  if (!navigator.mediaDevices || !window.MediaRecorder) {
    showErrors($("voice-form"), { field: "prompt_wav", message: "prompt_wav: recording needs https or localhost (the browser hides the microphone elsewhere); choose a file instead" });
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (exc) {
    showErrors($("voice-form"), { field: "prompt_wav", message: `prompt_wav: no microphone (${exc.message})` });
    return;
  }
  const parts = [];
  recorder = new MediaRecorder(stream);
  const startedAt = performance.now();
  const timer = setInterval(() => {
    $("rec-info").textContent = `recording… ${((performance.now() - startedAt) / 1000).toFixed(1)} s`;
  }, 100);
  recorder.ondataavailable = (event) => { if (event.data.size) parts.push(event.data); };
  recorder.onstop = async () => {
    clearInterval(timer);
    for (const track of stream.getTracks()) track.stop();
    const raw = new Blob(parts, { type: recorder.mimeType });
    recorder = null;
    $("record-btn").textContent = "Record";
    $("record-btn").classList.remove("recording");
    // MediaRecorder writes webm/opus in Chromium; the server reads wav/flac/mp3/ogg: convert here
    const decoded = await decodeToMono(await player.ensureContext(), raw);
    const blob = decoded ? wavFromFloat(decoded.samples, decoded.sampleRate) : raw;
    await useRecording(blob, "recording.wav", "microphone");
  };
  recorder.start();
  pg.recordingStarted = true;
  $("record-btn").textContent = "Stop recording";
  $("record-btn").classList.add("recording");
}

async function registerVoice(event) {
  event.preventDefault();
  const form = $("voice-form");
  clearErrors(form);
  pg.voiceError = null;
  const name = $("voice-name").value.trim();
  if (!name) { showErrors(form, { field: "name", message: "name: give the voice a name" }); return; }
  if (!recording) { showErrors(form, { field: "prompt_wav", message: "prompt_wav: choose a file or record one" }); return; }
  const body = new FormData();
  body.append("name", name);
  body.append("prompt_text", $("voice-text").value);
  body.append("prompt_wav", recording.blob, recording.filename);
  $("register-btn").disabled = true;
  setStatus("voice-status", "Analysing the recording…");
  const result = await api("/v1/voices", { method: "POST", body });
  $("register-btn").disabled = false;
  if (!result.ok) {
    pg.voiceError = result.error;
    showErrors(form, result.error);
    setStatus("voice-status", "");
    return;
  }
  const v = result.data;
  pg.voiceMessage = `registered ${v.name}`;
  setStatus("voice-status", `Registered ${v.name}: ${v.prompt_seconds.toFixed(1)} s, ${v.num_prompt_tokens} speech tokens.`);
  await loadVoices();
  $("voice").value = v.name;
}

// ------------------------------------------------------------------ wiring

function wire() {
  $("speak-form").addEventListener("submit", (event) => { event.preventDefault(); startRun("speak"); });
  $("live-btn").addEventListener("click", () => startRun("live"));
  $("finish-btn").addEventListener("click", finishLive);
  $("write-btn").addEventListener("click", writeAtRate);
  $("stop-btn").addEventListener("click", stop);
  $("download-btn").addEventListener("click", downloadWav);
  $("tab-whole").addEventListener("click", () => selectTab("speak"));
  $("tab-live").addEventListener("click", () => selectTab("live"));
  $("mode").addEventListener("change", updateModeFields);
  $("text").addEventListener("input", () => { if (ws && pg.kind === "live" && writeTimer === null && !pg.endSent) flushLiveText(false); });
  $("text").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      if (pg.kind === "live" && ws) finishLive();
      else if (!ws) startRun($("tab-live").getAttribute("aria-selected") === "true" ? "live" : "speak");
    }
  });
  $("voice-form").addEventListener("submit", registerVoice);
  $("record-btn").addEventListener("click", toggleRecording);
  $("voice-file").addEventListener("change", async () => {
    const file = $("voice-file").files[0];
    if (!file) return;
    clearErrors($("voice-form"));
    if (!$("voice-name").value.trim()) {
      $("voice-name").value = file.name.replace(/\.[^.]*$/, "").replace(/[^A-Za-z0-9_.-]+/g, "-").slice(0, 64);
    }
    await useRecording(file, file.name, file.name);
  });
  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors($("key-form"));
    apiKey = $("api-key").value.trim();
    await loadVoices();
    pollReady();
  });
}

wire();
selectTab("speak");
updateModeFields();
renderMetrics();
pollReady();
loadVoices();
