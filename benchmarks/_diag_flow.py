import os, sys, torch
sys.path.insert(0, "tests")
from pathlib import Path
import subprocess, tempfile
from safetensors.torch import load_file
from cosystream.checkpoint import load_checkpoint
from cosystream.config import ChunkSchedule
from cosystream.engine.chunking import ChunkPlanner
from cosystream.engine.flow_runner import FlowRunner
from cosystream.engine.loader import load_flow
from cosystream.kernels import reference, flow as fk
from cosystream.models.flow_stream import FlowStream
fx = Path(os.environ["COSYSTREAM_FIXTURES"])
out = Path(tempfile.mkdtemp())
subprocess.run([sys.executable, str(fx.parent / "materialize.py"), str(fx), str(out)], check=True, capture_output=True)
ckpt = load_checkpoint(out / "model")
f = load_file(str(fx / "stream.safetensors"))
cpu_flow = load_flow(ckpt); stream = FlowStream(cpu_flow, final_attention="chunk")
prompt = stream.build_prompt_cache(f["prompt_token"], f["prompt_feat"], f["embedding"])
for graphs, ops, enc in [(True, fk, False), (False, fk, True), (True, fk, True)]:
    gpu_flow = load_flow(ckpt, "cuda"); gs = FlowStream(gpu_flow, final_attention="chunk")
    gp = gs.build_prompt_cache(f["prompt_token"].cuda(), f["prompt_feat"].cuda(), f["embedding"].cuda())
    print("prompt kv diff", (gp.kv.cpu() - prompt.kv).abs().max().item())
    runner = FlowRunner(gpu_flow, num_slots=3, max_frames=512, use_graphs=graphs); runner.attention_ops = ops
    from cosystream.engine.graphs import GraphCache
    runner.encoder_graphs = GraphCache(runner._encode_core, runner.device, enc)
    toks = [f["token"][0][:100], (f["token"][0][:100] * 5 + 11) % 6561]
    pooled = [runner.open(gp) for _ in toks]; alone = [stream.start(prompt, 100) for _ in toks]
    planners = [ChunkPlanner(ChunkSchedule(), f["prompt_token"].shape[1]) for _ in toks]
    while True:
        plans = [p.next_plan(100, done=True) for p in planners]
        if plans[0] is None or plans[0].is_final: break
        ids = [t[: plans[0].token_end].unsqueeze(0) for t in toks]
        windows = [gs._window(s, i.cuda(), finalize=False) for s, i in zip(pooled, ids)]
        starts = [s.num_frames for s in pooled]
        got = runner.advance(pooled, windows)
        d = []
        for b in range(2):
            want = stream.feed(alone[b], ids[b])
            mel = gs._target_frames(pooled[b], got[b][None], starts[b]).cpu()
            d.append(round((mel - want).abs().max().item(), 5))
        print("ode graphs", graphs, "encoder graphs", enc, starts, d)
