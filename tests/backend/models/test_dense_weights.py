"""Dense weights that a kernel reads from their stored blocks are held in those blocks
alone (``DenseWeights``): reading one gives the float32 values the loader held before,
and decoding never needs them."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig, SamplingParams
from backend.engine.loop import Engine
from backend.formats.tensors import MappedFiles
from backend.kernels import native
from backend.kernels.quants import QType, dequantize
from backend.messages import Finished, Submit, TokenEvent
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from backend.models.weights import DenseWeights
from tests.helpers.engine_runs import drain
from tests.helpers.qblocks import random_blocks
from tests.helpers.reference import greedy_logits
from tests.helpers.tiny import make_tiny

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("dense")
    model = load_model(make_tiny("mixtral", root / "mixtral"))
    return {
        q.name: write_gguf(model, root / f"m.{q.name}.gguf", q) for q in (QType.Q4_1, QType.Q8_0)
    }


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0], ids=["q4_1", "q8_0"])
def test_attention_is_held_in_its_blocks_with_the_values_it_had(tiny_files, qtype) -> None:
    """Each layer's q, k, v and output projections are held as blocks where the native
    kernels build (elsewhere as float32, which the compiled graphs' fallback needs), and
    read back bit for bit as the float32 copy the loader kept before; norms stay
    tensors; what is held is smaller than the float copies."""
    path = tiny_files[qtype.name]
    model = load_model(path)
    t, refs = model.transformer, model.dense_refs
    in_blocks = native.available()
    files = MappedFiles()
    floats = 0
    for layer in range(model.config.n_layers):
        for n in ATTENTION:
            name = f"blk.{layer}.{n}"
            assert t.w.in_blocks(name) == in_blocks, name
            before = files.load(refs[name])
            assert torch.equal(t.w[name], before), name
            floats += before.numel() * 4
        assert not t.w.in_blocks(f"blk.{layer}.attn_norm")
    if in_blocks:
        assert t.fused["blk.0.attn_qkv"].qtype == qtype
        others = sum(v.numel() * v.element_size() for k, v in t.w.items() if "attn_" not in k)
        assert t.held_bytes() < others + floats / 3


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_1, QType.Q4_K], ids=lambda q: q.name)
def test_rows_decode_as_the_whole_weight(qtype) -> None:
    """An embedding lookup decodes only the rows asked for, the same bits as those rows
    of the whole weight, for ids of any shape."""
    n, k = 37, 256
    raw = random_blocks(qtype, n, k, seed=4)
    w = DenseWeights({"norm": torch.ones(k)})
    w.keep_blocks("token_embd", raw, qtype, (n, k))
    whole = dequantize(raw, qtype, (n, k))
    assert torch.equal(w["token_embd"], whole)
    for ids in (torch.tensor([0, 36, 5, 5]), torch.tensor([[3, 1], [2, 0]]), torch.tensor([9])):
        assert torch.equal(w.rows("token_embd", ids), whole[ids])
    assert w.decoded == 1  # (rows are not counted: they are what a lookup needs)
    assert set(w) == {"norm", "token_embd"} and len(w) == 2
    w["token_embd"] = whole
    assert not w.in_blocks("token_embd") and w["token_embd"] is whole


def test_decoding_reads_no_weight_from_its_blocks(tiny_files) -> None:
    """A prompt's BLAS products decode the weights held in blocks; decoding steps decode
    none, in plain generation as in the engine (prompts read beside other requests'
    decoding there): more steps, no more decoding."""
    if not native.available():
        pytest.skip("weights are held in blocks only where the native kernels build")
    model = load_model(tiny_files["Q4_1"])
    w = model.transformer.w
    assert w.in_blocks("blk.0.attn_q")
    counts = []
    for steps in (1, 8):
        before = w.decoded
        greedy_logits(model, [3, 17, 42, 5], steps=steps)
        counts.append(w.decoded - before)
    assert counts[0] > 0 and counts[0] == counts[1]
    # The engine: once every prompt has its first token, no more decoding.
    eng = Engine(model, EngineConfig(policy="bevy", cache="1.0", storage="host"))
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, p in enumerate(([3, 17, 42, 5], [9, 8, 7])):
            eng.submit(Submit(f"r{i}", params, prompt_ids=p))
        started: set[str] = set()
        for _ in range(1000):
            if len(started) == 2:
                break
            eng.step()
            started |= {e.request_id for e in drain(eng) if isinstance(e, TokenEvent)}
        assert len(started) == 2
        before = w.decoded
        eng.run_until_idle(120)
        finished = [e for e in drain(eng) if isinstance(e, Finished)]
        assert len(finished) == 2 and all(len(f.token_ids) == 12 for f in finished)
        assert w.decoded == before
    finally:
        eng.close()


def test_quantized_untied_embedding_is_held_in_blocks(tmp_path, monkeypatch) -> None:
    """An untied embedding stored quantized (as llama.cpp's converter writes most files;
    our exporter keeps it float32, so the test has it quantize the embedding too) is held
    in its blocks where the native kernels build, looked up row by row: the same
    logits."""
    from backend.models import gguf_export

    model = load_model(make_tiny("mixtral", tmp_path / "m"))
    assert not model.config.tie_embeddings
    monkeypatch.setattr(gguf_export, "_KEEP_F32_NAMES", ("output",))
    path = write_gguf(model, tmp_path / "m.gguf", QType.Q8_0)
    monkeypatch.undo()
    ours = load_model(path)
    assert ours.dense_refs["token_embd"].qtype == QType.Q8_0
    t = ours.transformer
    assert t.w.in_blocks("token_embd") == native.available()
    _, got = greedy_logits(ours, [3, 17, 42, 5], steps=4)
    t.w["token_embd"] = MappedFiles().load(ours.dense_refs["token_embd"])
    _, ref = greedy_logits(ours, [3, 17, 42, 5], steps=4)
    assert torch.equal(got, ref)


def _mapped_rss_kib(address: int) -> int:
    """Resident KiB of the map that holds ``address`` (Linux ``smaps``): that map only,
    as other tests' loads may map the same file."""
    ours = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                ours = lo <= address < hi
            elif ours and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError(f"no map holds {address:#x}")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux smaps")
def test_released_map_leaves_the_resident_set_and_reads_the_same(tmp_path) -> None:
    """What loading read through the file's map is dropped from the process's resident
    set once copied out (``MappedFiles.release``), and reading the map again gives the
    same bytes."""
    from backend.formats.tensors import TensorRef

    path = tmp_path / "blob.bin"
    data = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    files = MappedFiles()
    ref = TensorRef(path, 0, data.numel(), QType.F32, (data.numel() // 4,))
    view = files.bytes_of(ref)
    assert torch.equal(view, data)  # every page read
    assert _mapped_rss_kib(view.data_ptr()) > 12 << 10
    files.release()
    assert _mapped_rss_kib(view.data_ptr()) < 1 << 10
    assert torch.equal(view, data)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux smaps")
def test_a_loaded_model_holds_no_page_of_its_file(tiny_files) -> None:
    """The load's reads of the dense weights are released: the weights it keeps are its
    own copies."""
    model = load_model(tiny_files["Q4_1"])
    ref = next(iter(model.dense_refs.values()))
    assert _mapped_rss_kib(model.files.bytes_of(ref).data_ptr()) == 0  # a view reads nothing
    assert model.transformer.held_bytes() > 0
