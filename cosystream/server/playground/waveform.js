// The received audio as a waveform on a canvas, growing as chunks arrive, with the chunk
// boundaries, the playback position and the player's underruns marked on it.

const BLOCK = 240;          // samples per peak (10 ms at 24 kHz)
const MIN_VIEW_S = 6;       // the time axis spans at least this much, so short replies are not stretched

export class Waveform {
  constructor(canvas, sampleRate) {
    this.canvas = canvas;
    this.sampleRate = sampleRate;
    this.colors = readColors(canvas);
    this.clear();
    new ResizeObserver(() => this.draw()).observe(canvas);
  }

  clear() {
    this.mins = [];
    this.maxs = [];
    this.pending = null;    // a partial block carried to the next chunk
    this.numSamples = 0;
    this.chunkStarts = [];  // seconds
    this.underruns = [];    // {atS, gapMs}
    this.played = null;     // seconds, or null
    this.draw();
  }

  addChunk(samples) {
    this.chunkStarts.push(this.numSamples / this.sampleRate);
    let data = samples;
    if (this.pending) {
      data = new Float32Array(this.pending.length + samples.length);
      data.set(this.pending);
      data.set(samples, this.pending.length);
      this.mins.pop();
      this.maxs.pop();
    }
    for (let start = 0; start < data.length; start += BLOCK) {
      let lo = 0;
      let hi = 0;
      const end = Math.min(start + BLOCK, data.length);
      for (let i = start; i < end; i++) {
        if (data[i] < lo) lo = data[i];
        if (data[i] > hi) hi = data[i];
      }
      this.mins.push(lo);
      this.maxs.push(hi);
    }
    const tail = data.length % BLOCK;
    this.pending = tail ? data.slice(data.length - tail) : null;
    this.numSamples += samples.length;
    this.draw();
  }

  setUnderruns(underruns) { this.underruns = underruns.slice(); this.draw(); }

  setPlayed(seconds) {
    if (seconds === this.played) return;
    this.played = seconds;
    this.draw();
  }

  draw() {
    const canvas = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * dpr));
    const height = Math.max(1, Math.round(canvas.clientHeight * dpr));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const g = canvas.getContext("2d");
    const c = this.colors;
    g.clearRect(0, 0, width, height);
    const seconds = this.numSamples / this.sampleRate;
    const viewS = Math.max(MIN_VIEW_S, seconds * 1.08);
    const pxPerS = width / viewS;
    const mid = height / 2;
    const amp = height * 0.44;

    // time grid: one line per second (per 5 s on long audio)
    const step = viewS > 30 ? 5 : 1;
    g.fillStyle = c.grid;
    g.font = `${10 * dpr}px system-ui, sans-serif`;
    for (let s = step; s < viewS; s += step) {
      const x = Math.round(s * pxPerS);
      g.fillRect(x, 0, dpr, height);
      g.fillText(`${s}s`, x + 3 * dpr, height - 4 * dpr);
    }
    g.fillRect(0, Math.round(mid), width, dpr);

    const playedX = this.played === null ? -1 : this.played * pxPerS;
    const blocksPerPx = this.sampleRate / BLOCK / pxPerS;
    const columns = Math.ceil(seconds * pxPerS);
    for (let x = 0; x < columns; x++) {
      const b0 = Math.floor(x * blocksPerPx);
      const b1 = Math.max(b0 + 1, Math.floor((x + 1) * blocksPerPx));
      let lo = 0;
      let hi = 0;
      for (let b = b0; b < b1 && b < this.mins.length; b++) {
        if (this.mins[b] < lo) lo = this.mins[b];
        if (this.maxs[b] > hi) hi = this.maxs[b];
      }
      g.fillStyle = x <= playedX ? c.played : c.wave;
      const top = mid - hi * amp;
      g.fillRect(x, top, 1, Math.max(dpr, mid - lo * amp - top));
    }

    g.fillStyle = c.chunk;
    for (const s of this.chunkStarts) g.fillRect(Math.round(s * pxPerS), height - 6 * dpr, dpr, 6 * dpr);

    for (const u of this.underruns) {
      const x = Math.round(u.atS * pxPerS);
      g.fillStyle = c.underrun;
      g.fillRect(x - dpr, 0, 2 * dpr, height);
      g.beginPath();
      g.moveTo(x - 5 * dpr, 0);
      g.lineTo(x + 5 * dpr, 0);
      g.lineTo(x, 7 * dpr);
      g.fill();
      g.fillText(`${Math.round(u.gapMs)} ms`, x + 4 * dpr, 16 * dpr);
    }

    if (playedX >= 0) {
      g.fillStyle = c.played;
      g.fillRect(Math.round(playedX), 0, dpr, height);
    }
  }
}

function readColors(el) {
  const style = getComputedStyle(el);
  const v = (name, fallback) => style.getPropertyValue(name).trim() || fallback;
  return {
    wave: v("--wave", "#9aa7bd"), played: v("--accent", "#2f6fed"), grid: v("--grid", "#e6e9ef"),
    chunk: v("--chunk", "#7c8aa5"), underrun: v("--danger", "#d93f3f"),
  };
}
