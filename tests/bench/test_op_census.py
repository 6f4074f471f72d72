"""benchmarks/op_census.py on the fixture model: the launches each graph body makes, by call site. Each test
also pins what a path must no longer launch, so launches taken out of the CUDA graphs stay out."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_scripts import import_benchmark

BLOCKS, GROUPS, STEPS = 4, 4, 10  # the fixture estimator: one block in each of 4 groups; 10 Euler steps


@pytest.fixture(scope="module")
def census():
    return import_benchmark("op_census")


def _ops(counts, where: str = "") -> dict[str, int]:
    """Launches per operation, from the call sites that contain `where`."""
    out: dict[str, int] = {}
    for (op, site), n in counts.items():
        if where in site:
            out[op] = out.get(op, 0) + n
    return out


@pytest.mark.slow  # ~5 s: a benchmark script
def test_a_final_pass_step_gathers_its_time_terms_and_ends_in_the_fused_tail(census, model_dir: Path) -> None:
    counts = census.final_step_launches(str(model_dir), frames=96).counts
    assert _ops(counts)["fused:pooled_attention"] == BLOCKS
    assert "arange" not in {**_ops(counts, "estimator.py"), **_ops(counts, "flow_fast.py")}  # the pass's rows
    # serve every attention block
    assert _ops(counts, "_final_step_core") == {"index_select": 1, "fused:project_cfg_euler": 1}  # dt; the tail
    assert _ops(counts, "_final_step_times") == {"index_select": 2}  # its time terms, by the step index
    everything = _ops(counts)
    assert not {"sin", "cos", "exp", "silu", "mish"} & set(everything)  # no time embedding in the graph
    assert "conv1d" not in _ops(counts, "_step")  # no final 1x1 projection of its own


def test_a_chunk_ode_step_launches_five_kernels_a_transformer_block(census, model_dir: Path) -> None:
    counts = census.chunk_ode_launches(str(model_dir), prompt_frames=50, new_frames=50).counts
    blocks = _ops(counts, "_pooled_transformers")
    assert sum(blocks.values()) == STEPS * 5 * BLOCKS  # each group's residual add rides in its last GEMM
    assert blocks["fused:linear_residual"] == STEPS * 2 * BLOCKS  # output and second feed-forward projections
    assert _ops(counts, "_residual") == {"fused:linear_residual": STEPS * GROUPS}  # every ResNet's 1x1 conv
    assert _ops(counts)["fused:project_cfg_euler"] == STEPS


def test_the_prefill_samples_in_one_kernel_and_gathers_no_keys(census, model_dir: Path) -> None:
    counts = census.prefill_launches(str(model_dir), positions=64).counts
    assert _ops(counts, "_first_tokens_fused") == {"fused:linear": 1, "index_copy_": 1,
                                                   "fused:sample_and_record": 1, "index_select": 1}
    assert not _ops(counts, "sampling.py")  # the torch sampler is not in the graph
    layers = _ops(counts)["fused:rope_write_kv"]
    assert _ops(counts, "qwen2.py") == {  # a layer: 8 launches, and the prompt's positions and rows
        "fused:add_rms_norm": 2 * layers + 1, "fused:linear": 3 * layers, "fused:rope_write_kv": layers,
        "scaled_dot_product_attention": layers, "fused:silu_linear": layers, "arange": 1, "repeat": 1,
        "repeat_interleave": 1}


def test_the_encoder_projects_qkv_once_a_layer_and_makes_no_position_table(census, model_dir: Path) -> None:
    counts = census.encoder_launches(str(model_dir), prompt_tokens=25, new_tokens=25).counts
    encoder = _ops(counts, "flow.py")
    layers = encoder["softmax"]
    assert not {"sin", "cos", "exp"} & set(encoder)
    # a layer: q/k/v, positions, output, two feed-forward GEMMs; three input projections (tokens, look-ahead,
    # upsampled frames); one write of the new keys and values
    assert encoder["linear"] == 5 * layers + 3
    assert encoder["copy_"] == layers


def test_the_report_is_a_table_per_path(census, model_dir: Path, capsys) -> None:
    census.report("LM decode step, one row", census.decode_step_launches(str(model_dir), 1), 1, 5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("## LM decode step, one row: ") and lines[2].startswith("| launches |")
    assert len(lines) == 4 + 5
