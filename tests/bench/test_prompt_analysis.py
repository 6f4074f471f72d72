"""benchmarks/prompt_analysis.py runs on the CPU with a fixture model and reports what it measured."""

from __future__ import annotations

import json

from benchmark_scripts import import_benchmark


def test_prompt_analysis_benchmark_reports_times_and_agreement(fixture_dir, tmp_path, capsys):
    bench = import_benchmark("prompt_analysis")
    out = tmp_path / "report.json"
    args = bench.build_parser().parse_args(
        ["--model-dir", str(fixture_dir / "model"), "--device", "cpu", "--seconds", "1", "--batch-sizes", "1,3",
         "--dtypes", "float32,bfloat16", "--speaker-threads", "2", "--repeats", "1", "--compare-unfolded",
         "--graph-threads", "2", "--out", str(out)])
    report = bench.run(args)
    bench.print_report(report)
    out.write_text(json.dumps(report))
    fp32 = report["dtypes"]["float32"]
    assert fp32["prompts"] == 3 and fp32["prompts_all_tokens_equal"] == 3 and fp32["token_agreement"] == 1.0
    assert fp32["xvector_max_abs_diff"] < 1e-4
    for entry in report["dtypes"].values():
        assert entry["batch1_ms_per_prompt"] > 0 and entry["batch3_ms_per_prompt"] > 0
        assert entry["tokenizer_batch_mode"] in ("padded", "same_length", "single")
        assert 0.0 <= entry["token_agreement"] <= 1.0
        assert set(entry["parts_ms_per_prompt"]) == {"tokens", "xvector", "mel"}
    assert report["onnx_cpu_ms_per_prompt"] > 0
    hybrid = report["dtypes"]["float32+campplus_cpu2"]
    assert hybrid["speaker_batch_mode"] == "onnxruntime_cpu" and hybrid["prompts_all_tokens_equal"] == 3
    assert hybrid["xvector_max_abs_diff"] == 0.0  # the same onnxruntime session and features as the reference
    assert "bfloat16" in capsys.readouterr().out
    # operator calls per graph call: a cached shape runs the compute nodes alone, a new length at most the plan
    for graph, ops in fp32["graph_ops_per_call"].items():
        assert ops["ops_cached_shape"] == ops["compute"] <= ops["ops_new_length"] <= ops["plan"], graph
        assert report["dtypes"]["float32_unfolded"]["graph_ops_per_call"][graph]["ops_cached_shape"] == ops["plan"]
    assert fp32["host_syncs_largest_batch"] is None  # counted on CUDA only
    assert fp32["batch3_cached_shapes_ms_per_prompt"] > 0
    threaded = report["dtypes"]["float32+graph_threads2"]
    assert threaded["prompts_all_tokens_equal"] == 3
    assert threaded["xvector_max_abs_diff"] == fp32["xvector_max_abs_diff"]  # the same results, computed at once


def test_prompt_analysis_benchmark_reports_the_campplus_path(fixture_dir, tmp_path):
    """With CAM++ of the released architecture (reduced width), the default variant runs the batched network and
    reports its operator calls; --compare-interpreter adds the interpreter's variant."""
    from cosystream.testing.realistic_side_models import write_campplus

    model = tmp_path / "model"
    model.mkdir()
    for path in (fixture_dir / "model").iterdir():
        (model / path.name).symlink_to(path)
    write_campplus(model / "campplus.onnx", "small", seed=5)
    bench = import_benchmark("prompt_analysis")
    args = bench.build_parser().parse_args(
        ["--model-dir", str(model), "--device", "cpu", "--seconds", "1", "--batch-sizes", "1,2", "--dtypes",
         "float32", "--speaker-threads", "0", "--repeats", "1", "--compare-interpreter"])
    report = bench.run(args)
    bench.print_report(report)
    network, interpreter = report["dtypes"]["float32"], report["dtypes"]["float32+campplus_interpreter"]
    assert network["speaker_batch_mode"] == "campplus_module"
    assert network["speaker_fallback"] is None and "campplus" not in network["graph_ops_per_call"]
    assert network["graph_ops_per_call"]["campplus_module"]["torch_ops_one_prompt"] > 0
    assert interpreter["speaker_batch_mode"] == "same_length" and "fast_campplus=False" in interpreter[
        "speaker_fallback"]
    for entry in (network, interpreter):
        assert entry["xvector_max_abs_diff"] < 1e-4 and entry["prompts_all_tokens_equal"] == 2
