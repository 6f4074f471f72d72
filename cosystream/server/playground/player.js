// Gap-free playback of 16-bit PCM chunks as they arrive, through queued AudioBufferSourceNodes.
//
// Each chunk is scheduled to start exactly where the previous one ends on the AudioContext clock, so
// consecutive chunks join sample for sample. The first chunk starts one scheduling margin after it
// arrives (plus any extra buffer the user asks for); a chunk that arrives after the previous one has
// finished playing is an underrun: it starts one margin later and the gap is recorded.

export const SAMPLE_RATE = 24000;
// Time the audio thread needs between scheduling and rendering: a start time closer than this to
// currentTime may already be inside the block being rendered, and would be clipped.
const MARGIN_S = 0.03;
const LATE_EPSILON_S = 0.005;

export class PcmPlayer {
  constructor() {
    this.ctx = null;
    this.reset();
  }

  /** Create or resume the AudioContext; call from a user gesture (autoplay rules). */
  async ensureContext() {
    if (!this.ctx) {
      try {
        // a 24 kHz context: chunk boundaries fall on whole frames, no per-buffer resampling
        this.ctx = new AudioContext({ sampleRate: SAMPLE_RATE, latencyHint: "interactive" });
      } catch {
        this.ctx = new AudioContext({ latencyHint: "interactive" });
      }
    }
    if (this.ctx.state !== "running") await this.ctx.resume();
    return this.ctx;
  }

  reset(extraBufferS = 0) {
    for (const src of this.sources || []) {
      try { src.stop(); } catch { /* already stopped */ }
    }
    this.sources = [];
    this.extraBufferS = extraBufferS;
    this.nextTime = null;          // context time where the next chunk starts
    this.startTime = null;         // context time of the first sample
    this.segments = [];            // {ctxStart, audioStart, duration}: where each chunk plays
    this.underruns = [];           // {atS: audio position, gapMs}
    this.scheduledSamples = 0;
    this.leadMs = null;
    this.leadParts = null;
    this.stopped = false;
  }

  /** Schedule one chunk of samples (Float32Array in [-1, 1]); `arrivedAt` is performance.now() of its bytes. */
  push(samples, arrivedAt) {
    if (this.stopped || samples.length === 0) return;
    const ctx = this.ctx;
    const buffer = ctx.createBuffer(1, samples.length, SAMPLE_RATE);
    buffer.getChannelData(0).set(samples);
    const src = ctx.createBufferSource();
    src.buffer = buffer;
    src.connect(ctx.destination);
    const now = ctx.currentTime;
    const audioStart = this.scheduledSamples / SAMPLE_RATE;
    let when;
    if (this.nextTime === null) {
      when = now + MARGIN_S + this.extraBufferS;
      this.startTime = when;
    } else if (this.nextTime < now + LATE_EPSILON_S) {
      when = now + MARGIN_S;
      this.underruns.push({ atS: audioStart, gapMs: (when - this.nextTime) * 1000 });
    } else {
      when = this.nextTime;
    }
    src.start(when);
    src.onended = () => { this.sources = this.sources.filter((s) => s !== src); };
    this.sources.push(src);
    this.segments.push({ ctxStart: when, audioStart, duration: buffer.duration });
    this.nextTime = when + buffer.duration;
    this.scheduledSamples += samples.length;
    if (this.leadMs === null) this.measureLead(when, arrivedAt);
  }

  /**
   * The page's own buffering: from the first PCM bytes arriving to their scheduled playback, on the
   * performance.now() clock. getOutputTimestamp() maps context time to that clock at the output, so
   * the figure includes the output latency the browser reports.
   */
  measureLead(when, arrivedAt) {
    const ctx = this.ctx;
    const stamp = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
    const outputLatencyS = (ctx.outputLatency || 0) + (ctx.baseLatency || 0);
    let playsAt;
    if (stamp && stamp.performanceTime > 0) {
      playsAt = stamp.performanceTime + (when - stamp.contextTime) * 1000;
    } else {
      playsAt = performance.now() + (when - ctx.currentTime + outputLatencyS) * 1000;
    }
    this.playsAt = playsAt;
    this.leadMs = playsAt - arrivedAt;
    this.leadParts = {
      marginMs: MARGIN_S * 1000,
      extraBufferMs: this.extraBufferS * 1000,
      outputLatencyMs: outputLatencyS * 1000,
      processingMs: performance.now() - arrivedAt,
    };
  }

  stop() {
    this.stopped = true;
    for (const src of this.sources) {
      try { src.stop(); } catch { /* not started or already stopped */ }
    }
    this.sources = [];
  }

  get scheduledSeconds() { return this.scheduledSamples / SAMPLE_RATE; }

  /** True while scheduled audio is still to be played. */
  get isPlaying() {
    return !this.stopped && this.nextTime !== null && this.ctx.currentTime < this.nextTime;
  }

  /** The audio position (seconds into the received audio) being heard now, or null before the start. */
  playedSeconds() {
    if (!this.ctx || this.startTime === null) return null;
    const now = this.ctx.currentTime;
    let position = 0;
    for (const seg of this.segments) {
      if (now < seg.ctxStart) break;
      position = seg.audioStart + Math.min(now - seg.ctxStart, seg.duration);
    }
    return position;
  }
}

/** 16-bit little-endian PCM bytes → Float32 samples; an odd trailing byte is returned to carry over. */
export function pcm16ToFloat(bytes) {
  const count = bytes.byteLength >> 1;
  // an Int16Array view needs an even offset; copy the (rare) unaligned frame once
  const aligned = bytes.byteOffset % 2 === 0 ? bytes : bytes.slice();
  const ints = new Int16Array(aligned.buffer, aligned.byteOffset, count);
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = ints[i] / 32768;
  const rest = 2 * count < bytes.byteLength ? bytes.slice(2 * count) : null;
  return { samples: out, ints, rest };
}
