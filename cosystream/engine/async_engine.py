"""AsyncEngine: the asyncio front of the engine. Frontend work in a thread pool, GPU work on the core.

    engine = AsyncEngine.from_pretrained("CosyVoice2-0.5B", device="cuda", dtype="bfloat16")
    async for chunk in engine.synthesize(SynthesisParams(text="Hello!", voice="alice")):
        play(chunk.pcm)

Closing the iterator early (client gone) aborts the request and frees its LM slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.checkpoint.hub import resolve_model
from cosystream.config import EngineConfig
from cosystream.engine import accounting, calibration
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.core import EngineCore
from cosystream.engine.devices import with_device_defaults
from cosystream.engine.families import build_runners
from cosystream.engine.lm_runner import RowSampling
from cosystream.engine.load_log import loading
from cosystream.engine.prompt_batcher import PromptBatcher
from cosystream.engine.request import RequestState, Segment
from cosystream.engine.scheduler import Verdict
from cosystream.engine.upload_cache import UPLOAD_KEY_PREFIX, UploadCache
from cosystream.engine.voices import VoiceInfo, VoiceStore, check_voice_name, default_db_path
from cosystream.errors import BadInput, CosyStreamError, Overloaded, VoiceExists
from cosystream.frontend import Frontend, ModelInputs, VoicePrompt
from cosystream.outputs import AudioChunk
from cosystream.params import Mode, SynthesisParams

log = logging.getLogger("cosystream.engine")
_CACHE_PREFIX = "flow_prompt_cache."  # voice-record extras holding the encoded flow prompt
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Requests waiting for an LM slot beyond which new ones are refused (Overloaded), whatever the budget.
MAX_WAITING = 256
FRONTEND_THREADS = 2  # text normalisation and prompt analysis beside the event loop
# A request in a voice already in memory whose text has at most this many characters is prepared on the
# caller's event loop (≈ 0.1 ms) instead of a frontend thread: two thread hops fewer, and a burst is not
# queued behind the frontend threads. Longer texts, prompt audio and voice conversion go to the threads.
INLINE_FRONTEND_CHARS = 400


class AsyncEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig) -> None:
        self.config = config
        with loading(f"checkpoint {model_dir} (yaml, files)"):
            self.checkpoint = ckpt = load_checkpoint(model_dir)
        self.hparams = ckpt.hparams
        device, dtype = torch.device(config.device), _DTYPES[config.dtype]
        with loading("frontend (tokenizer, text normaliser, ONNX speaker and speech-token models)"):
            self.frontend = Frontend(ckpt, device=config.device)
        self.voices = VoiceStore(config.voices_db or default_db_path())
        self.lm, lm_runner, t2w = build_runners(ckpt, config, device, dtype)
        self.token2wav = t2w
        self.core = EngineCore(lm_runner, t2w, self.lm, config)
        # prompt recordings are analysed on the GPU in batches when the engine runs on CUDA (ONNX on the CPU);
        # built after the runners, so that the flow pool, sized from the GPU memory then free, does not shrink by
        # what the analysis' models and CUDA graphs hold
        self.prompt_batcher = PromptBatcher.for_engine(self.frontend, ckpt, config.device)
        self.prompt_batcher.costs = lambda: self.core.scheduler.prompt_costs  # admission's, measured analyses
        self._admitted = 0  # streams admitted (EngineCore.admit) ...
        self._not_submitted = 0  # ... of which never reached the engine (their frontend failed)
        self.pool = ThreadPoolExecutor(max_workers=FRONTEND_THREADS, thread_name_prefix="frontend")
        self._voice_prompts: dict[str, VoicePrompt] = {}
        # prompt recordings sent with requests (zero-shot without a registered voice), by content: a client
        # that sends the same reference with every request gets its analysis and encoded flow prompt reused
        self._uploads = UploadCache()
        # A registered voice's caches are keyed by its registration (name + creation time), not its name
        # alone: a request still running for a deleted voice must not hand its prompt state to a new
        # voice registered under the same name.
        self._voice_keys: dict[str, str] = {}
        self._voice_caches: dict[str, dict[str, torch.Tensor]] = {}  # stored flow prompt caches (CPU)
        persist = config.tuning.persist_voice_caches
        if persist or (persist is None and device.type == "cpu"):
            t2w.on_new_voice_cache = self._store_voice_cache
        # the one place the interpreter's switch interval is set (the engine thread and the token-to-wave
        # worker both feed the GPU from Python)
        self._switch_interval = sys.getswitchinterval()
        if config.gil_switch_interval_s is not None:
            sys.setswitchinterval(config.gil_switch_interval_s)
        self.core.start()
        self._freeze_heap()

    def _freeze_heap(self) -> None:
        """PERF: move every object alive now (modules, weights' wrappers, graphs, the libraries) out of the
        cyclic collector's reach (gc.freeze, process-wide). A full collection walks every tracked object
        while holding the GIL: 107–126 ms for the ≈ 356,000 objects of the tiny test engine on the build
        machine's CPU (`git show f313fec^:benchmarks/gc_pause.py`), a stall of the engine thread (and so of
        every stream) whenever enough survivors pile up; frozen, it walks only what came after. Objects are
        still freed when their last reference goes; close() unfreezes them."""
        if self.config.tuning.gc_freeze:
            gc.collect()
            gc.freeze()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> AsyncEngine:
        """`model_dir`: a model directory or a hub id such as FunAudioLLM/CosyVoice2-0.5B (downloaded once, see
        cosystream.checkpoint.hub). Any EngineConfig field may be given as a keyword; an unknown one raises
        TypeError. Without `device`, cuda when there is one, else cpu (dtype: bfloat16 on cuda, float32 on cpu)."""
        return cls(resolve_model(model_dir), EngineConfig.from_kwargs(**with_device_defaults(kwargs)))

    def close(self) -> None:
        self.core.stop()
        self.pool.shutdown(wait=False)
        self.prompt_batcher.close()
        sys.setswitchinterval(self._switch_interval)
        if self.config.tuning.gc_freeze:
            gc.unfreeze()  # the engine's cycles become collectable again

    # ------------------------------------------------------------------ synthesis
    async def synthesize(self, params: SynthesisParams) -> AsyncIterator[AudioChunk]:
        """Yield the audio of one request chunk by chunk; the last chunk has is_final and its times."""
        loop = asyncio.get_running_loop()
        t_submit = loop.time()
        self._check_text(params)
        if self.core.queue_depth >= MAX_WAITING:
            raise Overloaded(f"queue full ({self.core.queue_depth} waiting); retry later", retry_after_s=1.0)
        verdict = self._admit(params)
        queue: asyncio.Queue[AudioChunk | BaseException] = asyncio.Queue()

        def emit(item: AudioChunk | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        req = None
        try:
            # on the loop only when it cannot wait there: a frontend thread normalising a long text holds it
            with self.frontend.normalizer_if_free() as free:
                if free and self._cheap_frontend(params):
                    req = self._build_request(params, emit)
            if req is None:
                req = await loop.run_in_executor(self.prompt_batcher.pool_for(params, self.pool),
                                                 self._build_request, params, emit)
        except BaseException:
            self._not_submitted += 1
            raise
        if verdict is not None:
            req.predicted_first_audio_s = req.times.predicted_first_audio_s = verdict.predicted_first_audio_s
            req.times.predicted_first_chunk_start_s = verdict.predicted_start_s
        req.emit = self._emit_or_abort(req.request_id, req.emit)
        req.times.frontend_s = loop.time() - t_submit
        req.t_submit -= req.times.frontend_s  # the request's clock starts at submission
        self.core.submit(req)
        pump = None
        if not isinstance(params.text, str):
            pump = asyncio.create_task(self._pump_text(req.request_id, params.text, queue))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.is_final:
                    return
        finally:
            if pump is not None:
                pump.cancel()
            if not req.finished:
                self.core.abort(req.request_id)

    def _check_text(self, params: SynthesisParams) -> None:
        """The one text-length limit (EngineConfig.max_text_chars), for every entry point and every text
        field (streamed text is counted as it arrives, _pump_text)."""
        limit = self.config.max_text_chars
        for field, text in (("text", params.text), ("prompt_text", params.prompt_text),
                            ("instruct_text", params.instruct_text)):
            if isinstance(text, str) and len(text) > limit:
                raise BadInput(f"{field}: {len(text)} characters, more than the limit of {limit}")

    def predict_first_audio(self) -> tuple[float, bool]:
        """(predicted first audio of a stream arriving now, whether admission would take it) for a router
        choosing between engines; counts nothing (Scheduler.admit on the latest published view)."""
        schedule = self.config.schedule
        core = self.core
        view = core.published
        pending = max(0, self._admitted - self._not_submitted - (view.added if view is not None else 0))
        verdict = core.scheduler.admit(view, time.perf_counter(), schedule.first_hop + schedule.lookahead, pending,
                                       self.prompt_batcher.backlog())
        return verdict.predicted_first_audio_s, verdict.admitted

    def _admit(self, params: SynthesisParams) -> Verdict | None:
        """Admission (EngineConfig.first_audio_budget_s): Overloaded unless the scheduler predicts this
        stream's first audio within the budget with every running stream on time; returns its verdict."""
        if self.config.first_audio_budget_s is None:
            return None
        schedule = self.config.schedule
        tokens = (params.first_hop or schedule.first_hop) + schedule.lookahead if params.stream else 0
        verdict = self.core.admit(tokens, pending=self._admitted - self._not_submitted,
                                  prompts=self.prompt_batcher.backlog(self.is_new_recording(params)))
        if not verdict.admitted:
            raise Overloaded(f"overloaded: {verdict.reason}; retry later", retry_after_s=verdict.retry_after_s)
        self._admitted += 1
        return verdict

    def expecting_recording(self) -> contextlib.AbstractContextManager[Callable[[], None]]:
        """PromptBatcher.expecting_recording: the caller's request is about to bring a recording."""
        return self.prompt_batcher.expecting_recording()

    def is_new_recording(self, params: SynthesisParams) -> bool:
        """Does this request bring a recording whose analysis is not kept (so admission counts the analysis it
        will wait for)? Hashing the
        recording (a fraction of a millisecond for a few seconds of audio) is skipped while nothing is kept."""
        if params.prompt_audio is None:
            return False
        if not len(self._uploads):
            return True
        key = _upload_key(params.prompt_audio, params.prompt_text or "")
        return key is None or key not in self._uploads

    def _cheap_frontend(self, params: SynthesisParams) -> bool:
        """Is preparing this request quick enough for the event loop (see INLINE_FRONTEND_CHARS)?"""
        if not isinstance(params.text, str) or len(params.text) > INLINE_FRONTEND_CHARS:
            return False
        if params.prompt_audio is not None or params.source_audio is not None:
            return False
        try:
            mode = Mode(params.mode)
        except ValueError:  # _build_request names the problem
            return False
        return mode == Mode.sft or params.voice in self._voice_prompts

    def _emit_or_abort(self, request_id: str, emit: Any) -> Any:
        """The request's emit, made safe for the engine thread: if the caller's event loop has closed, nobody
        will read or abort the request any more, so it is aborted here instead of raising on the engine thread."""
        def deliver(item: AudioChunk | BaseException) -> None:
            try:
                emit(item)
            except RuntimeError:  # call_soon_threadsafe on a closed loop
                self.core.abort(request_id)
        return deliver

    async def _pump_text(self, request_id: str, pieces: AsyncIterator[str], out: asyncio.Queue) -> None:
        """Forward text pieces as they arrive (tokenised one by one, not normalised: spec/frontend.md §2)."""
        num_chars = 0
        try:
            async for piece in pieces:
                if not isinstance(piece, str):
                    raise BadInput(f"text: streamed pieces must be strings, got {type(piece).__name__}")
                num_chars += len(piece)
                if num_chars > self.config.max_text_chars:
                    raise BadInput(f"text: more than the limit of {self.config.max_text_chars} characters")
                ids = self.frontend.encode_text(piece)
                if ids:
                    self.core.add_text(request_id, ids)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the client's text source failed: end the request with its error
            out.put_nowait(e if isinstance(e, BadInput) else BadInput(f"text: the text stream failed: {e}"))
            self.core.abort(request_id)
            return
        self.core.end_text(request_id)

    def _build_request(self, params: SynthesisParams, emit) -> RequestState:
        _check_params(params)
        started = time.perf_counter()
        self.prompt_batcher.take_analysis_s()  # (what an earlier request left on this thread)
        voice, voice_key = self._resolve_voice(params)
        prompt_s, analysis_s = time.perf_counter() - started, self.prompt_batcher.take_analysis_s()
        if isinstance(params.text, str):
            segments = [self._segment(inputs, params) for inputs in self._model_inputs(params, voice)]
        else:
            segments = [self._text_stream_segment(params, voice)]
        req = RequestState(
            request_id=params.request_id or uuid.uuid4().hex, segments=segments,
            sampling=self._row_sampling(params), emit=emit, voice_key=voice_key,
            voice_cache=self._voice_caches.get(voice_key) if voice_key else None,
            force_tokens=params.force_tokens, speed=params.speed)
        req.times.prompt_s, req.times.prompt_analysis_s = prompt_s, analysis_s
        return req

    def _model_inputs(self, params: SynthesisParams, voice: VoicePrompt | None) -> list[ModelInputs]:
        fe, mode = self.frontend, Mode(params.mode)
        if mode == Mode.vc:
            if params.source_audio is None:
                raise BadInput("source_wav: voice conversion needs the speech to convert")
            return [fe.inputs_vc(params.source_audio, voice)]
        texts = fe.segments(params.text)
        if mode == Mode.zero_shot:
            return [fe.inputs_zero_shot(t, voice) for t in texts]
        if mode == Mode.cross_lingual:
            return [fe.inputs_cross_lingual(t, voice) for t in texts]
        if mode == Mode.instruct2:
            return [fe.inputs_instruct2(t, params.instruct_text, voice) for t in texts]
        return [fe.inputs_sft(t, params.sft_speaker or params.voice or "") for t in texts]

    def _segment(self, inputs: ModelInputs, params: SynthesisParams) -> Segment:
        num_text = int(inputs.text_ids.shape[0])
        planner = ChunkPlanner(self.config.schedule, int(inputs.flow_prompt_speech_tokens.shape[0]),
                               block=self.hparams.chunk_size, stream=params.stream, first_hop=params.first_hop)
        min_len, max_len = 2 * num_text, 20 * num_text  # PARITY: spec/llm.md §4
        if params.force_tokens is not None:
            min_len = max_len = params.force_tokens
        segment = Segment(inputs=inputs, planner=planner, min_len=min_len, max_len=max_len)
        # sos + prompt text + text + task id + prompt speech must fit the LM context, or prefill fails
        num_prompt = 2 + num_text + int(inputs.prompt_text_ids.shape[0]) + int(inputs.llm_prompt_speech_tokens.shape[0])
        if not segment.skips_lm and num_prompt >= self.config.max_len:
            raise BadInput(f"text: a sentence of {num_text} tokens does not fit the model's context of "
                           f"{self.config.max_len} positions with this voice; split it with punctuation")
        return segment

    def _text_stream_segment(self, params: SynthesisParams, voice: VoicePrompt | None) -> Segment:
        mode = Mode(params.mode)
        if mode in (Mode.vc, Mode.sft) or voice is None:
            raise BadInput(f"mode: text streaming supports zero_shot, cross_lingual and instruct2, not {mode.value}")
        empty = torch.zeros(0, dtype=torch.int32)
        prompt_text = self.frontend.text_stream_prompt_ids(mode.value, voice, params.instruct_text)
        inputs = ModelInputs(
            mode=mode.value, text_ids=empty, xvector=voice.xvector, prompt_text_ids=prompt_text,
            llm_prompt_speech_tokens=voice.prompt_speech_tokens if mode == Mode.zero_shot else empty,
            flow_prompt_speech_tokens=voice.prompt_speech_tokens, prompt_mel=voice.prompt_mel)
        planner = ChunkPlanner(self.config.schedule, int(voice.prompt_speech_tokens.shape[0]),
                               block=self.hparams.chunk_size, stream=params.stream, first_hop=params.first_hop)
        return Segment(inputs=inputs, planner=planner, min_len=0, max_len=self.config.max_len, text_stream=True)

    def _row_sampling(self, params: SynthesisParams) -> RowSampling:
        d, s = self.hparams.llm, params.sampling
        return RowSampling(
            seed=s.seed if s.seed is not None else random.getrandbits(31),
            top_p=s.top_p if s.top_p is not None else d.top_p,
            top_k=s.top_k if s.top_k is not None else d.top_k,
            win_size=s.win_size if s.win_size is not None else d.win_size,
            tau_r=s.tau_r if s.tau_r is not None else d.tau_r,
            min_len=0, greedy=s.greedy, ban_special=params.force_tokens is not None)

    def _resolve_voice(self, params: SynthesisParams) -> tuple[VoicePrompt | None, str | None]:
        if Mode(params.mode) == Mode.sft:
            return None, None
        if params.voice is not None and params.prompt_audio is None:
            prompt = self.voice_prompt(params.voice)
            return prompt, self._voice_keys[params.voice]
        if params.prompt_audio is None:
            raise BadInput("voice: give a registered voice name or a prompt_wav")
        key = _upload_key(params.prompt_audio, params.prompt_text)
        def analyse() -> VoicePrompt:
            return self.prompt_batcher.make_voice_prompt(params.prompt_audio, params.prompt_text)

        if key is None:
            return analyse(), None
        return self._uploads.get_or_make(key, analyse), key

    # ------------------------------------------------------------------ voices
    def voice_prompt(self, name: str) -> VoicePrompt:
        if name not in self._voice_prompts:
            record = self.voices.get(name)
            self._check_voice_family(name, record.prompt)
            key = _registration_key(record.info)
            cache = {k[len(_CACHE_PREFIX):]: v for k, v in record.extras.items() if k.startswith(_CACHE_PREFIX)}
            if cache:
                self._voice_caches[key] = cache
            self._voice_keys[name] = key
            self._voice_prompts[name] = record.prompt
        return self._voice_prompts[name]

    def _check_voice_family(self, name: str, prompt: VoicePrompt) -> None:
        """A voice's features come from its family's frontend (speech tokenizer v2 or v3, mel fmax, transcript
        specials): those of another family would be silently wrong here, so they are refused by name."""
        family = self.checkpoint.family
        if prompt.family != family:
            raise BadInput(f"voice: {name!r} was registered with a {prompt.family} model; its prompt features (speech "
                           f"tokens, mel) do not fit this {family} model. Register the recording again under "
                           f"another name with this model (or delete {name!r} first)")

    def _store_voice_cache(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Engine thread: hand the encoded prompt to a frontend thread to write into the voice record."""
        if name.startswith(_UPLOAD_PREFIX):  # a request's own recording: no record to keep it in
            return
        self.pool.submit(self._write_voice_cache, name, tensors)

    def _write_voice_cache(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        name = key.split(_KEY_SEP, 1)[0]
        try:
            record = self.voices.get(name)
            if _registration_key(record.info) != key:  # deleted and registered anew meanwhile
                return
            extras = {k: v for k, v in record.extras.items() if not k.startswith(_CACHE_PREFIX)}
            self.voices.set_extras(name, {**extras, **{_CACHE_PREFIX + k: v for k, v in tensors.items()}})
            self._voice_caches[key] = tensors
        except CosyStreamError:  # the voice was deleted meanwhile: nothing to keep
            pass

    async def add_voice(self, name: str, audio: Any, prompt_text: str) -> VoiceInfo:
        """Analyse the prompt once and store it; the name is checked before any audio work."""
        check_voice_name(name)
        if name in self.voices:
            raise VoiceExists(f"name: a voice named {name!r} already exists (delete it first)")
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self.pool, self.prompt_batcher.make_voice_prompt, audio, prompt_text)
        return await loop.run_in_executor(self.pool, lambda: self.voices.add(name, prompt, prompt_text))

    async def delete_voice(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.pool, self.voices.delete, name)
        self._voice_prompts.pop(name, None)
        key = self._voice_keys.pop(name, None)
        if key is not None:
            self._voice_caches.pop(key, None)
            await loop.run_in_executor(self.pool, self.core.call, self.token2wav.forget_voice, key)

    async def drop_cached_voice(self, name: str) -> None:
        """Forget what this process holds in memory for `name` (its prompt, its flow prompt cache), not the
        stored voice: another process registered, replaced or deleted it, so the next request reads the store."""
        self._voice_prompts.pop(name, None)
        key = self._voice_keys.pop(name, None)
        if key is not None:
            self._voice_caches.pop(key, None)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.pool, self.core.call, self.token2wav.forget_voice, key)

    def cached_voices(self) -> list[str]:
        """Registered voices whose prompt features this process holds in memory."""
        return list(self._voice_prompts)

    def cached_uploads(self) -> list[str]:
        """Hex digests (of the recording's bytes and its transcript) of the uploaded prompts this process holds
        analysed, most recently used last: what a router matches a request's upload against."""
        return [key[len(_UPLOAD_PREFIX):] for key in self._uploads.held()]

    def stats(self) -> dict[str, float]:
        return {**self.core.stats(), **accounting.gauges(self), **self._prompt_stats()}

    def _prompt_stats(self) -> dict[str, float]:
        """Recordings sent with requests: their analysis batches (GPU engines) and the upload cache."""
        batches, uploads = self.prompt_batcher.stats, self._uploads
        return {"prompt_analysis_batches": float(batches.batches), "prompt_analysis_prompts": float(batches.prompts),
                "prompt_analysis_largest_batch": float(batches.largest_batch),
                "upload_cache_entries": float(len(uploads)), "upload_cache_bytes": float(uploads.bytes),
                "upload_cache_hits": float(uploads.hits), "upload_cache_misses": float(uploads.misses),
                "upload_cache_evictions": float(uploads.evictions)}

    def list_voices(self) -> list[VoiceInfo]:
        return self.voices.list()

    def get_voice(self, name: str) -> VoiceInfo:
        return self.voices.get(name).info

    # ------------------------------------------------------------------ warm-up
    def warmup(self, prompt_tokens: int = 150, target_tokens: int = 250) -> int:
        """Capture CUDA graphs before serving: every LM decode bucket, the LM prefill of up to 16 prompts
        of up to 512 positions, and the flow/HiFT shapes of the
        chunk schedule for a prompt of `prompt_tokens` and `target_tokens` generated tokens at every
        batch size. Other shapes are captured on first use. Then the batched prompt analysis runs once on
        synthetic recordings (PromptBatcher.warm_up). Returns the number of graphs."""
        n = self.core.call(self.token2wav.warmup, prompt_tokens, target_tokens, self.config.schedule)
        n += self.core.call(self.core.capture_prefill)
        n += self.core.call(self.core.lm_runner.capture_all)
        self.core.call(self.core.measure_decode_step)  # the cost model's decode step on this device
        if self.core.lm_runner.device.type == "cuda":  # (a CPU engine learns them from its first requests)
            try:
                self.core.call(self.measure_phase_costs)
            except Exception:  # admission then learns the phase costs from the first requests' phases
                log.exception("token-to-wave phase calibration failed")
        try:
            self.prompt_batcher.warm_up()
        except Exception:  # the first request with a recording then shows what is wrong, as its own error
            log.exception("prompt analysis warm-up failed")
        self._freeze_heap()  # the graphs' objects too
        return n


    def measure_phase_costs(self, sizes: tuple[int, ...] = (1, 16), prompt_tokens: int | None = None,
                            num_tokens: int | None = None, repeats: int = 2) -> dict[tuple[str, int], float]:
        """Warm-up (engine thread, nothing running): the token-to-wave phase costs admission predicts from
        (engine/calibration.py), measured with a silent prompt (by default of the warm-up's lengths)."""
        flow = self.hparams.flow
        inputs = calibration.neutral_inputs(prompt_tokens or calibration.CALIBRATION_PROMPT_TOKENS,
                                            flow.output_size, flow.spk_embed_dim)
        return calibration.measure_phases(self.token2wav, self.core.scheduler.cost, inputs, self.config.schedule,
                                          self.hparams.chunk_size, sizes, repeats,
                                          num_tokens or calibration.CALIBRATION_TOKENS)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_params(p: SynthesisParams) -> None:
    if p.speed <= 0 or p.speed > 4:
        raise BadInput(f"speed: must be in (0, 4], got {p.speed}")
    if p.speed != 1.0 and p.stream:
        raise BadInput("speed: changing speed needs stream=false (the official model allows it offline only)")
    if p.first_hop is not None and not 1 <= p.first_hop <= 100:
        raise BadInput(f"first_hop: must be in [1, 100] speech tokens, got {p.first_hop}")
    if p.force_tokens is not None and not 1 <= p.force_tokens <= 4000:
        raise BadInput(f"force_tokens: must be in [1, 4000], got {p.force_tokens}")


_KEY_SEP = "\x00"  # cannot occur in a voice name (check_voice_name refuses control characters)


_UPLOAD_PREFIX = UPLOAD_KEY_PREFIX  # voice keys of uploaded prompts (no voice name contains the separator)


def _upload_key(audio: Any, prompt_text: str) -> str | None:
    """The voice key of an uploaded prompt: a digest of its content and transcript (None when the audio is
    of a kind not worth hashing, e.g. a path that cannot be read: the frontend then names the problem)."""
    digest = hashlib.sha256()
    if isinstance(audio, (bytes, bytearray, memoryview)):
        digest.update(bytes(audio))
    elif isinstance(audio, (str, Path)):
        try:
            digest.update(Path(audio).read_bytes())
        except OSError:
            return None
    elif isinstance(audio, tuple) and len(audio) == 2:
        samples, rate = audio
        try:
            array = np.ascontiguousarray(samples.detach().cpu().numpy() if isinstance(samples, torch.Tensor)
                                         else samples)
        except (TypeError, ValueError):
            return None
        digest.update(f"{array.dtype}{array.shape}{rate}".encode())
        digest.update(array.tobytes())
    else:
        return None
    digest.update(b"\0" + prompt_text.encode())
    return _UPLOAD_PREFIX + digest.hexdigest()


def _registration_key(info: Any) -> str:
    """Identifies one registration of a voice: its name and its creation time."""
    return f"{info.name}{_KEY_SEP}{info.created_at!r}"
