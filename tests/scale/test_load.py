"""The routing policy and the /metrics merge of the Ray application (scale/load.py), without a cluster."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cosystream.scale.load import LoadReport, merge_metrics, rank_replicas


def test_expected_first_audio_follows_the_admission_formula() -> None:
    load = LoadReport(in_flight=6, capacity=4, service_first_audio_s=0.1, service_s=2.0, budget_s=1.0)
    # 6 in flight on 4 slots: the new stream waits for 6 - 4 + 1 = 3 slots, each freeing after 2.0 / 4 s
    assert load.expected_first_audio_s() == 0.1 + 3 * 2.0 / 4
    assert load.expected_first_audio_s(3) == 0.1  # a free slot: no wait
    assert not load.fits_budget() and load.fits_budget(3)
    assert LoadReport().expected_first_audio_s() is None and LoadReport().fits_budget()
    assert LoadReport.from_dict(load.as_dict()) == load
    assert LoadReport.from_dict({}) is None and LoadReport.from_dict({"in_flight": "many"}) is None


def test_ranking_prefers_ready_then_within_budget_then_voice_then_least_loaded() -> None:
    base = {"capacity": 4, "service_first_audio_s": 0.1, "service_s": 2.0, "budget_s": 1.0}
    loads = {
        "dead": LoadReport(ready=False, in_flight=0, **base),
        "busy": LoadReport(in_flight=3, **base),
        "idle": LoadReport(in_flight=0, **base),
        "full": LoadReport(in_flight=8, **base),  # expected 0.1 + 5 * 0.5 s: over the budget
        "fuller": LoadReport(in_flight=12, **base),
        "voice": LoadReport(in_flight=2, voices=("anna",), **base),
    }
    assert rank_replicas(loads) == ["idle", "voice", "busy", "full", "fuller", "dead"]
    assert rank_replicas(loads, voice="anna") == ["voice", "idle", "busy", "full", "fuller", "dead"]
    # streams this router sent that the (older) reports do not show yet count too
    assert rank_replicas(loads, routed_here={"idle": 4}) == ["voice", "busy", "idle", "full", "fuller", "dead"]
    assert rank_replicas(loads, routed_here={"idle": 10})[:2] == ["voice", "busy"]
    # when none can meet the budget, the one closest to it comes first (its admission then refuses at once)
    over = {k: v for k, v in loads.items() if k in ("full", "fuller")}
    assert rank_replicas(over) == ["full", "fuller"]


def test_idle_replicas_share_the_work() -> None:
    loads = {"a": LoadReport(), "b": LoadReport(), "c": None}  # c has not reported yet: idle and ready
    firsts = {rank_replicas(loads)[0] for _ in range(200)}
    assert firsts == {"a", "b", "c"}


def _exposition(requests: float, latency_s: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("cosystream_requests", "finished requests", ["endpoint"], registry=registry)
    counter.labels("tts").inc(requests)
    histogram = Histogram("cosystream_first_audio_seconds", "first audio", buckets=(0.1, 1.0), registry=registry)
    for value in latency_s:
        histogram.observe(value)
    return generate_latest(registry).decode()


def test_merged_metrics_label_every_sample_with_its_replica() -> None:
    texts = {"r1": _exposition(3, [0.05, 0.5]), "r2": _exposition(5, [2.0])}
    merged = {f.name: f for f in text_string_to_metric_families(merge_metrics(texts).decode())}
    requests = {s.labels["replica"]: s.value for s in merged["cosystream_requests"].samples
                if s.name == "cosystream_requests_total"}
    assert requests == {"r1": 3.0, "r2": 5.0}
    counts = {s.labels["replica"]: s.value for s in merged["cosystream_first_audio_seconds"].samples
              if s.name == "cosystream_first_audio_seconds_count"}
    assert counts == {"r1": 2.0, "r2": 1.0}
    text = merge_metrics(texts).decode()
    assert text.count("# TYPE cosystream_requests_total counter") == 1  # one family, both replicas' samples


def test_uploads_and_voice_aliases_count_as_held_prompts() -> None:
    from cosystream.scale.load import held_voice_names, upload_key

    names = held_voice_names(["bob", "anna"], aliases=[("narrator", "bob"), ("ghost", "carl")],
                             default_voice="anna", default_names=["alloy", "bob"])
    assert names == ["bob", "anna", "narrator", "alloy"]  # no alias of a voice not held; no name twice
    assert held_voice_names(["bob"], default_voice="anna", default_names=["alloy"]) == ["bob"]
    base = {"capacity": 4, "service_first_audio_s": 0.1, "service_s": 2.0, "budget_s": 1.0}
    key = upload_key("ab" * 32)
    loads = {"cold": LoadReport(in_flight=0, **base), "warm": LoadReport(in_flight=1, uploads=(key,), **base)}
    assert LoadReport.from_dict(loads["warm"].as_dict()) == loads["warm"]
    assert rank_replicas(loads, voice=key) == ["warm", "cold"]
    assert rank_replicas(loads, voice=upload_key("cd" * 32)) == ["cold", "warm"]
    # an upload key is never matched against voice names, nor a voice against uploads
    assert not LoadReport(voices=(key,)).holds(key) and not LoadReport(uploads=("bob",)).holds("bob")


def _full(**changes) -> LoadReport:
    """A report of a replica whose engine refused a new stream at t=100 (busy, with a budget, no API keys)."""
    fields = {"in_flight": 3, "service_first_audio_s": 0.8, "budget_s": 0.5, "admits": False, "open_access": True,
              "reported_at": 100.0}
    return LoadReport(**{**fields, **changes})


def test_a_replica_is_known_full_only_on_a_fresh_refusing_report_whose_load_cannot_have_fallen() -> None:
    assert LoadReport.from_dict(_full().as_dict()) == _full()
    assert _full().known_full(0, now=100.4, fresh_s=1.0)
    assert _full().known_full(2, now=100.4, fresh_s=1.0)  # more streams sent there since: still full
    assert not _full().known_full(-1, now=100.4, fresh_s=1.0)  # a stream ended there since: it may take one
    assert not _full().known_full(None, now=100.4, fresh_s=1.0)  # nothing known since
    assert not _full().known_full(0, now=101.5, fresh_s=1.0)  # too old
    for other in (_full(admits=True), _full(admits=None), _full(ready=False), _full(in_flight=0),
                  _full(budget_s=None), _full(open_access=False), _full(reported_at=None)):
        assert not other.known_full(0, now=100.4, fresh_s=1.0), other


def test_the_proxy_refuses_only_when_every_replica_is_known_full() -> None:
    from cosystream.scale.load import every_replica_full

    def net(value: int | None):
        return lambda since: value

    assert every_replica_full([(_full(), net(0)), (_full(reported_at=100.2), net(1))], now=100.5, fresh_s=1.0)
    assert not every_replica_full([(_full(), net(0)), (_full(admits=True), net(0))], now=100.5, fresh_s=1.0)
    assert not every_replica_full([(_full(), net(0)), (None, net(0))], now=100.5, fresh_s=1.0)  # no report yet
    assert not every_replica_full([], now=100.5, fresh_s=1.0)
    asked: list[float] = []
    every_replica_full([(_full(reported_at=99.9), lambda since: asked.append(since) or 0)], now=100.5, fresh_s=1.0)
    assert asked == [99.9]  # the ledger is asked about the time of that replica's own report


def test_a_replica_load_is_its_report_moved_on_by_what_the_router_saw_since() -> None:
    from cosystream.scale.load import in_flight_now

    report = LoadReport(in_flight=16)
    assert in_flight_now(report, open_here=6, net_since_report=-10) == 6  # 10 of the 16 ended since the report
    assert in_flight_now(report, open_here=3, net_since_report=-14) == 3  # never below this router's open streams
    assert in_flight_now(report, open_here=0, net_since_report=2) == 18  # two more started there since
    assert in_flight_now(report, open_here=4, net_since_report=None) == 16  # the ledger does not reach back
    assert in_flight_now(None, open_here=4, net_since_report=None) == 4  # no report yet


def test_estimated_loads_replace_the_reports_and_refusing_replicas_rank_last() -> None:
    base = {"service_first_audio_s": 0.1, "budget_s": 0.5}
    loads = {"a": LoadReport(in_flight=16, **base), "b": LoadReport(in_flight=8, **base)}
    assert rank_replicas(loads) == ["b", "a"]  # by the reports
    assert rank_replicas(loads, in_flight={"a": 6, "b": 8}) == ["a", "b"]  # by the router's estimate of now
    assert rank_replicas(loads, routed_here={"a": 9}, in_flight={"a": 6, "b": 8}) == ["b", "a"]  # a lower bound
    # a replica that refused the request comes after every other, the unready and the over-budget ones included
    loads["c"] = LoadReport(ready=False, **base)
    loads["d"] = LoadReport(in_flight=2, service_first_audio_s=0.9, budget_s=0.5)
    assert rank_replicas(loads, in_flight={"a": 6, "b": 8}, avoid={"a"}) == ["b", "d", "c", "a"]


def test_the_scale_table_splits_a_level_by_the_replica_that_served_each_request() -> None:
    from benchmarks.scale_table import replica_split

    def served(replica: str | None, start_s: float, end_s: float | None) -> dict:
        return {"start_s": start_s, "end_s": end_s, "server": {"replica": replica} if replica else {"refusal_s": 0.01}}

    requests = [served("a", 0.0, 1.0), served("a", 0.5, 1.5), served("a", 1.0, 2.0), served("b", 0.0, 1.0),
                served(None, 0.2, 0.21), served("b", 3.0, None)]  # a refusal; a request that never ended
    # the level spans 0 to 2 s: a's requests were open 3 s of it in all, b's 1 s
    assert replica_split(requests) == {"a": (3, 1.5), "b": (1, 0.5)}
    assert replica_split([served(None, 0.0, 1.0)]) == {} and replica_split([]) == {}


def test_the_scale_table_measures_how_unevenly_streams_were_spread_at_each_moment() -> None:
    from benchmarks.scale_table import busiest_share

    def on(replica: str, start_s: float, end_s: float) -> dict:
        return {"start_s": start_s, "end_s": end_s, "server": {"replica": replica}}

    # waves taking turns: 3 streams on a then 3 on b; even over the level, never even at a moment
    turns = [on("a", 0.0, 1.0) for _ in range(3)] + [on("b", 1.0, 2.0) for _ in range(3)]
    assert abs(busiest_share(turns) - 1.0) < 1e-9
    even = [on("a", 0.0, 2.0), on("b", 0.0, 2.0), on("a", 0.0, 2.0), on("b", 0.0, 2.0)]
    assert abs(busiest_share(even) - 0.5) < 1e-9
    assert busiest_share([{"start_s": 0.0, "end_s": 1.0, "server": {}}]) is None
