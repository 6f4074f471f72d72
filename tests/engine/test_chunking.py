"""The official chunk schedule (fixture manifest stream.schedule and spec/streaming.md §2)."""

from __future__ import annotations

import pytest

from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner


def _run(planner: ChunkPlanner, total: int) -> list:
    plans = []
    for available in range(total + 1):
        while (plan := planner.next_plan(available, done=False)) is not None:
            plans.append(plan)
    while (plan := planner.next_plan(total, done=True)) is not None:
        plans.append(plan)
    return plans


@pytest.mark.parity
def test_recorded_official_schedule(manifest, load_fixture):
    info = manifest["stream"]
    total = load_fixture("stream")["token"].shape[1]
    plans = _run(ChunkPlanner(ChunkSchedule(), info["prompt_token_len"]), total)
    recorded = info["schedule"]
    assert [p.token_end for p in plans] == [c["n_tokens"] for c in recorded]
    assert [p.offset for p in plans] == [c["token_offset"] for c in recorded]
    assert [p.is_final for p in plans] == [c["finalize"] for c in recorded]
    assert [2 * p.num_new for p in plans] == [c["mel_frames_sliced"] for c in recorded]


def test_worked_example_of_the_spec():
    plans = _run(ChunkPlanner(ChunkSchedule(), prompt_len=150), total=300)
    assert [(p.offset, p.num_new, p.token_end) for p in plans[:4]] == [
        (0, 25, 28), (25, 50, 78), (75, 100, 178), (175, 100, 278)]
    assert plans[-1].is_final and plans[-1].offset + plans[-1].num_new == 300
    assert sum(p.num_new for p in plans) == 300


def test_prompt_padding_and_options():
    assert ChunkPlanner(ChunkSchedule(), prompt_len=137).tokens_needed() == 41
    small = ChunkPlanner(ChunkSchedule(first_hop=15, pad_prompt=False), prompt_len=137)
    assert small.tokens_needed() == 18
    flat = _run(ChunkPlanner(ChunkSchedule(growth=1), prompt_len=150), total=120)
    assert [p.num_new for p in flat] == [25, 25, 25, 25, 20]


def test_non_streaming_is_one_final_chunk():
    plans = _run(ChunkPlanner(ChunkSchedule(), prompt_len=150, stream=False), total=77)
    assert len(plans) == 1 and plans[0].is_final and plans[0].num_new == 77


def test_bad_schedule_is_rejected():
    with pytest.raises(ValueError, match="first_hop"):
        ChunkSchedule(first_hop=0).validate()


def test_short_first_hop_is_provisional_and_later_chunks_realign():
    plans = _run(ChunkPlanner(ChunkSchedule(), prompt_len=150, first_hop=15), total=300)
    assert (plans[0].offset, plans[0].num_new, plans[0].token_end, plans[0].provisional) == (0, 15, 18, True)
    for p in plans[1:-1]:
        assert not p.provisional and (150 + p.offset + p.num_new) % 25 == 0
    assert plans[1].num_new == 35  # 15 -> 30 grown, then extended to the block boundary at 200
    assert sum(p.num_new for p in plans) == 300


@pytest.mark.parametrize("stream", [True, False])
def test_next_is_final_foretells_the_next_plan(stream):
    planner = ChunkPlanner(ChunkSchedule(), 150, stream=stream)
    for available in range(0, 400, 7):
        done = available >= 350
        if not planner.has_plan(available, done):
            continue
        foretold = planner.next_is_final(available)
        assert planner.next_plan(available, done).is_final == foretold


@pytest.mark.parametrize("first_hop", [None, 15])
def test_peek_plan_returns_the_next_plan_and_leaves_the_planner_as_it_was(first_hop):
    planner = ChunkPlanner(ChunkSchedule(), 150, first_hop=first_hop)
    for available in range(0, 400, 11):
        done = available >= 350
        before = (planner.offset, planner.hop, planner.index, planner.finished)
        peeked = planner.peek_plan(available, done)
        assert (planner.offset, planner.hop, planner.index, planner.finished) == before
        assert peeked == planner.next_plan(available, done)
