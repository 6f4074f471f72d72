"""Admission with new recordings, through Scheduler.admit: a newcomer that brings a recording waits for its
analysis behind the recordings in line, and prompt passes (the flow over new prompts) are worker time that
delays first chunks. The expected times are worked out by hand from the measured costs below."""

from __future__ import annotations

import pytest

from cosystream.engine import costs
from cosystream.engine.prompt_load import PromptBacklog, PromptCosts, analysis_ends
from cosystream.engine.scheduler import CostModel, EngineView, Scheduler, StreamView, WorkerView

NOW = 100.0
STEP_S = 0.01
FIRST_S = 0.1  # one first chunk alone (the only phase size measured: PRIOR_FIXED_SHARE of it per call)
TOKENS = 30  # the newcomer's first chunk: 0.3 s of decode steps
# analysis batches: 0.02 s per batch + 0.01 s per prompt; prompt passes: 0.04 s per phase + 0.01 s per pass
ANALYSIS = (0.02, 0.01)
PASSES = (0.04, 0.01)


def _line_s(line: tuple[float, float], n: int) -> float:
    return line[0] + line[1] * n


def _scheduler(budget_s: float = 1.0, measured: bool = True) -> Scheduler:
    cost = CostModel()
    cost.observe_step(STEP_S)
    cost.observe_phase("first", 1, FIRST_S)
    s = Scheduler(cost, budget_s=budget_s)
    if measured:
        for n in (1, 16, 4, 8):  # several sizes: the fit recovers fixed and per-prompt seconds
            s.prompt_costs.observe_analysis(n, _line_s(ANALYSIS, n))
            s.prompt_costs.observe_passes(n, _line_s(PASSES, n))
    return s


def _first_phase_s(n: int) -> float:
    fixed = FIRST_S * costs.PRIOR_FIXED_SHARE
    return fixed + (FIRST_S - fixed) * n


def _running(key: str = "a") -> StreamView:
    """A running stream with audio to spare and no chunk ready: it takes no worker time soon."""
    return StreamView(key=key, arrival_s=NOW - 5, first=False, deadline_s=NOW + 9, opened=True, lm_decoding=True)


def _to_open(key: str, *, ready: bool, voice_at_hand: bool = False) -> StreamView:
    """A stream whose first chunk is ready (or being decoded, 0.2 s of steps to go), not opened yet."""
    return StreamView(key=key, arrival_s=NOW - 0.1, first=True, deadline_s=NOW + 0.9, ready=ready, opened=False,
                      decoding_audio=not ready, lm_decoding=not ready, missing_tokens=0 if ready else 20,
                      voice_at_hand=voice_at_hand)


def _view(*streams: StreamView, **kw) -> EngineView:
    kw.setdefault("worker", WorkerView())
    return EngineView(now=NOW, streams=list(streams), free_lm_slots=64, lm_slots=64, **kw)


def test_the_fit_recovers_the_measured_lines():
    s = _scheduler()
    for n in (1, 5, 16):
        assert s.prompt_costs.analysis_s(n) == pytest.approx(_line_s(ANALYSIS, n))
        assert s.prompt_costs.passes_s(n) == pytest.approx(_line_s(PASSES, n))
    assert PromptCosts().analysis_s(3) == 0.0 and PromptCosts().passes_s(3) == 0.0  # unmeasured: free


def test_analysis_ends_follow_the_batches_in_line():
    s = _scheduler()
    # 4 analysed since 10 ms ago, 20 queued, the newcomer's: batches of 16 after the running one
    backlog = PromptBacklog(new_recording=True, queued=20, running=4, running_since_s=NOW - 0.01, max_batch=16)
    ends = analysis_ends(backlog, s.prompt_costs, NOW)
    running_end = NOW - 0.01 + _line_s(ANALYSIS, 4)
    full = running_end + _line_s(ANALYSIS, 16)
    assert ends == pytest.approx([running_end] * 4 + [full] * 16 + [full + _line_s(ANALYSIS, 5)] * 5)
    assert analysis_ends(PromptBacklog(new_recording=True), s.prompt_costs, NOW) == pytest.approx(
        [NOW + _line_s(ANALYSIS, 1)])


def test_a_new_recording_delays_the_first_audio_by_its_analysis():
    s = _scheduler()
    view = _view(_running())
    known = s.admit(view, NOW, TOKENS)
    assert known.predicted_first_audio_s == pytest.approx(TOKENS * STEP_S + FIRST_S)
    new = s.admit(view, NOW, TOKENS, prompts=PromptBacklog(new_recording=True))
    # its prompt pass runs ahead while the LM decodes (0.05 s < 0.3 s): only the analysis adds
    assert new.predicted_first_audio_s == pytest.approx(_line_s(ANALYSIS, 1) + TOKENS * STEP_S + FIRST_S)
    # behind 20 queued recordings and a running batch of 4 (as above)
    crowded = PromptBacklog(new_recording=True, queued=20, running=4, running_since_s=NOW - 0.01, max_batch=16)
    analysed = analysis_ends(crowded, s.prompt_costs, NOW)[-1] - NOW
    behind = s.admit(view, NOW, TOKENS, prompts=crowded)
    assert behind.predicted_first_audio_s == pytest.approx(analysed + TOKENS * STEP_S + FIRST_S)
    assert not _scheduler(budget_s=0.5).admit(view, NOW, TOKENS, prompts=crowded).admitted
    assert _scheduler(budget_s=0.5).admit(view, NOW, TOKENS).admitted  # the same newcomer with a known voice


def test_prompt_passes_of_streams_to_open_are_worker_time():
    view_ready = _view(*[_to_open(f"f{i}", ready=True) for i in range(8)], _running())
    # eight first chunks ready, their voices new: opening them runs the eight passes in their phase
    with_passes = _scheduler().admit(view_ready, NOW, TOKENS)
    phase = _line_s(PASSES, 8) + _first_phase_s(8)
    assert phase > TOKENS * STEP_S  # the newcomer's tokens are there before that phase ends
    assert with_passes.predicted_first_audio_s == pytest.approx(phase + FIRST_S)
    # the same streams with their voices at hand: no pass, the phase ends before the newcomer's tokens
    at_hand = _view(*[_to_open(f"f{i}", ready=True, voice_at_hand=True) for i in range(8)], _running())
    assert _scheduler().admit(at_hand, NOW, TOKENS).predicted_first_audio_s == pytest.approx(
        TOKENS * STEP_S + FIRST_S)
    # forty streams still decoding their first chunk: their passes run ahead now, in one phase, and the
    # newcomer's first chunk waits for it
    decoding = _view(*[_to_open(f"d{i}", ready=False) for i in range(40)], _running(), free_flow_slots=None)
    ahead = _scheduler().admit(decoding, NOW, TOKENS)
    passes = _line_s(PASSES, 40)
    assert passes > TOKENS * STEP_S  # every first chunk, the newcomer's too, is ready before the passes end
    assert ahead.predicted_first_audio_s == pytest.approx(passes + _first_phase_s(41))
    unmeasured = _scheduler(measured=False).admit(decoding, NOW, TOKENS)  # as before passes were counted
    assert unmeasured.predicted_first_audio_s == pytest.approx(0.2 + _first_phase_s(40) + FIRST_S)


def test_the_newcomers_pass_runs_with_its_first_chunk_when_the_worker_is_busy_until_then():
    s = _scheduler()
    busy = WorkerView(busy=True, started_s=NOW, predicted_s=0.5)  # past the newcomer's analysis and tokens
    verdict = s.admit(_view(_running(), worker=busy), NOW, TOKENS, prompts=PromptBacklog(new_recording=True))
    assert verdict.predicted_first_audio_s == pytest.approx(0.5 + _line_s(PASSES, 1) + FIRST_S)
    # without open-ahead the pass always runs with the first chunk: after its tokens
    off = s.admit(_view(_running(), open_ahead=False), NOW, TOKENS, prompts=PromptBacklog(new_recording=True))
    assert off.predicted_first_audio_s == pytest.approx(
        _line_s(ANALYSIS, 1) + TOKENS * STEP_S + _line_s(PASSES, 1) + FIRST_S)


def test_admitted_requests_in_the_analysis_count_ahead_of_the_newcomer():
    s = _scheduler(budget_s=0.6)
    view = _view(_running())
    line = PromptBacklog(new_recording=False, queued=16, max_batch=16)
    alone = s.admit(view, NOW, TOKENS, prompts=line)  # the newcomer's voice is known: no analysis for it
    assert alone.admitted
    # the sixteen queued recordings belong to streams admitted since the view: after their analysis, their
    # passes (ahead, one phase) and their sixteen first chunks come due with the newcomer's
    crowd = s.admit(view, NOW, TOKENS, pending_new=16, prompts=line)
    assert crowd.admitted and crowd.predicted_first_audio_s > alone.predicted_first_audio_s
    # their analysis ends at 0.18 s, their passes take the idle worker until 0.38 s: the newcomer's chunk
    # (tokens at 0.3 s) goes next, before their own chunks (tokens at 0.48 s)
    assert crowd.predicted_first_audio_s == pytest.approx(_line_s(ANALYSIS, 16) + _line_s(PASSES, 16) + FIRST_S)
    assert not _scheduler(budget_s=0.45).admit(view, NOW, TOKENS, pending_new=16, prompts=line).admitted


def test_a_pass_ahead_starts_once_the_lm_decodes():
    """The worker opens a stream ahead of its first chunk only while its LM decodes: after the analysis and the
    prefill. A long pass that starts then delays the first chunk; had it started at the analysis, it would not."""
    s = _scheduler(measured=False)
    s.cost.observe_prefill(0.2)
    for n in (1, 16, 4, 8):
        s.prompt_costs.observe_analysis(n, _line_s(ANALYSIS, n))
        s.prompt_costs.observe_passes(n, 0.35 + 0.05 * n)  # one pass: 0.4 s
    decoding = _line_s(ANALYSIS, 1) + 0.2
    verdict = s.admit(_view(_running()), NOW, TOKENS, prompts=PromptBacklog(new_recording=True))
    assert 0.4 > TOKENS * STEP_S > 0.4 - 0.2  # outlasts the decode steps, not the prefill and the decode steps
    assert verdict.predicted_first_audio_s == pytest.approx(decoding + 0.4 + FIRST_S)
