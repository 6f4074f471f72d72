"""`cosystream make-random-model --family cosyvoice3`: the release layout, loadable, the real 0.5B shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from cosystream.checkpoint import load_checkpoint
from cosystream.checkpoint.hparams import load_hparams_cv3
from cosystream.engine.cv3_loader import load_cv3_flow, load_cv3_hift, load_cv3_llm
from cosystream.frontend.tokenizer import TextTokenizer
from cosystream.models.cosyvoice3.flow import CV3Flow
from cosystream.models.cosyvoice3.hift import CausalHiFT
from cosystream.models.cosyvoice3.lm import ENDOFPROMPT_ID, CosyVoice3LM, official_keys
from cosystream.models.cosyvoice3.stream import StreamSchedule, Token2WavStream
from cosystream.models.hift import is_weight_norm_key
from cosystream.testing.random_model import _unfold_weight_norm
from cosystream.testing.random_model_cv3 import SIZES_CV3, qwen_config_cv3, render_yaml_cv3

# spec/checkpoints.md §3.2, §3.4, §3.6: keys and parameters of the released files
RELEASE = {"llm": (293, 506_148_480), "flow": (330, 332_257_120), "hift": (328, 20_779_887)}


def test_cli_writes_a_loadable_tiny_model(tmp_path):
    out = tmp_path / "cv3"
    subprocess.run([sys.executable, "-m", "cosystream.cli", "make-random-model", str(out), "--family",
                    "cosyvoice3", "--seed", "2"], check=True, capture_output=True)
    ckpt = load_checkpoint(out)
    assert ckpt.family == "cosyvoice3"
    assert TextTokenizer(ckpt.files.tokenizer_dir, "cosyvoice3").token_id("<|endofprompt|>") == ENDOFPROMPT_ID
    lm, flow, hift = load_cv3_llm(ckpt), load_cv3_flow(ckpt), load_cv3_hift(ckpt, noise_seconds=5)
    assert lm.num_speech_classes == 6761
    prompt = torch.randint(0, 6561, (1, 30))
    tokens = torch.randint(0, 6561, (1, 80))
    stream = Token2WavStream(flow, hift, prompt, torch.randn(1, 60, 80), torch.randn(1, 192))
    schedule = StreamSchedule(prompt.shape[1])
    samples = 0
    with torch.no_grad():
        for call in schedule.all_calls(tokens.shape[1]):
            samples += stream.push(tokens, call).wav.shape[1]
    assert samples == 480 * 2 * tokens.shape[1]


def test_05b_shapes_match_the_release(tmp_path):
    size = SIZES_CV3["0.5b"]
    (tmp_path / "cosyvoice3.yaml").write_text(render_yaml_cv3(size))
    (tmp_path / "config.json").write_text(json.dumps(qwen_config_cv3(size)))
    hp = load_hparams_cv3(tmp_path / "cosyvoice3.yaml", tmp_path / "config.json")
    with torch.device("meta"):
        lm, flow, hift = CosyVoice3LM(hp.llm), CV3Flow(hp.flow), CausalHiFT(hp.hift)
    hift_state = _unfold_weight_norm(hift.state_dict(), is_weight_norm_key)
    counts = {
        "llm": (len(official_keys(hp.llm)), sum(p.numel() for p in lm.state_dict().values())),
        "flow": (len(flow.state_dict()), sum(p.numel() for p in flow.state_dict().values())),
        "hift": (len(hift_state), sum(p.numel() for p in hift_state.values())),
    }
    assert counts == RELEASE
