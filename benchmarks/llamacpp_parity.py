"""Our GGUF of a new family in llama.cpp's own server: the same greedy tokens and logprobs?

    python benchmarks/llamacpp_parity.py [--family qwen3_5_moe] [--qtype F32] [--layers LFLF]
        [--llama-server PATH] [--ggml-gelu]

Writes a tiny random model of ``--family`` (transformers' reference config, SmolLM2's
vocabulary so that llama.cpp has a tokenizer) as a GGUF with our exporter, then decodes
one random 40-token prompt greedily for 8 tokens with Bevy's plain generation and with
``llama-server`` (``/completion``, token ids in, top-5 logprobs out, f32 KV cache), and
prints both side by side. It checks the file, not just our own reading of it: names,
metadata keys, tensor layouts (Qwen3.5's tiled value heads, its M-RoPE sections) must be
what llama.cpp reads. For Qwen3.5 ``--layers`` picks each layer's kind (L: Gated
DeltaNet, F: full attention). llama-server is built as ``vs_llamacpp.py`` builds it.
Exit status 1 where the tokens differ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.demo.source import ensure_base_gguf  # noqa: E402
from backend.kernels.quants import QType  # noqa: E402
from backend.models.gguf_export import write_gguf  # noqa: E402
from backend.models.loader import load_model  # noqa: E402
from benchmarks.vs_llamacpp import build_llama_server, free_port  # noqa: E402
from tests.helpers import tiny  # noqa: E402
from tests.helpers.reference import greedy_logits  # noqa: E402


def llama_completion(exe: Path, model: Path, prompt: list[int], n: int) -> dict:
    with (model.parent / "llama-server.log").open("w") as log:
        return _complete(exe, model, prompt, n, log)


def _complete(exe: Path, model: Path, prompt: list[int], n: int, log) -> dict:
    port = free_port()
    cmd = [exe, "-m", model, "--port", str(port), "-t", "2", "-c", "512", "-np", "1"]
    cmd += ["-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    server = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if server.poll() is not None:
                raise SystemExit(f"llama-server exited ({server.returncode}); see {log.name}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = {"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 5}
        body |= {"cache_prompt": False, "samplers": ["top_k"], "top_k": 1, "return_tokens": True}
        req = urllib.request.Request(
            url + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        return json.load(urllib.request.urlopen(req, timeout=300))
    finally:
        server.terminate()
        server.wait()


def _ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU as ggml's CPU backend computes it (``GGML_GELU_FP16``): the input rounded to
    fp16, the tanh approximation's value looked up for it and rounded to fp16; the input
    itself from 10 on, 0 from -10 down."""
    table = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x >= 10, x, torch.where(x <= -10, torch.zeros_like(x), table))


def _use_ggml_gelu() -> None:
    from backend.models import gemma4, transformer

    transformer.gelu_tanh = gemma4.gelu_tanh = _ggml_gelu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_5_moe", choices=sorted(tiny.FAMILY_CONFIGS))
    ap.add_argument("--qtype", default="F32", choices=["F32", "F16", "Q8_0", "Q4_0"])
    ap.add_argument("--layers", default="LFLF", help="qwen3_5_moe: L linear, F full attention")
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument(
        "--ggml-gelu",
        action="store_true",
        help="compute GELU as ggml's CPU backend does (its fp16 table), to tell that "
        "rounding from a difference in the file",
    )
    args = ap.parse_args()
    if args.ggml_gelu:
        _use_ggml_gelu()
    exe = args.llama_server or build_llama_server(None)
    base = ensure_base_gguf(quiet=True)
    work = Path(tempfile.mkdtemp(prefix="llamacpp-parity-"))
    overrides = {}
    if args.family == "qwen3_5_moe":
        kinds = ["linear_attention" if k == "L" else "full_attention" for k in args.layers]
        overrides = {"layer_types": kinds, "num_hidden_layers": len(kinds)}
    make = tiny.make_tiny
    tiny.make_tiny = lambda family, folder: make(family, folder, **overrides)
    try:
        folder = tiny.make_tiny_chat(args.family, work / "hf", base)
    finally:
        tiny.make_tiny = make
    path = work / f"{args.family}.{args.qtype}.gguf"
    write_gguf(load_model(folder), path, QType[args.qtype], vocab_from=base)
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    ids, logits = greedy_logits(load_model(path), prompt, steps=7)
    ours = ids[len(prompt) :] + [int(logits[-1].argmax())]
    theirs = llama_completion(exe, path, prompt, 8)
    worst, same_so_far = 0.0, True
    for i, row in enumerate(theirs["completion_probabilities"]):
        lp = logits[i].log_softmax(-1)
        top = [(t["id"], t["logprob"]) for t in row["top_logprobs"]]
        if same_so_far:  # (after a different token the two read different contexts)
            worst = max(worst, max(abs(float(lp[t]) - p) for t, p in top))
            same_so_far = ours[i] == theirs["tokens"][i]
        ours_top = [(int(t), round(float(lp[t]), 4)) for t in lp.topk(5).indices]
        print(f"step {i}  bevy  {ours_top}")
        print(f"        llama {[(t, round(p, 4)) for t, p in top]}")
    same = ours == theirs["tokens"]
    print(f"{args.family} {args.qtype} {args.layers}: tokens {'equal' if same else 'DIFFER'}")
    print(
        f"largest |logprob difference| over llama.cpp's top-5 while the tokens agree: {worst:.2e}"
    )
    print(f"(the file: {path})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
