"""Bad model input: one clear line naming the file and the problem, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from backend.errors import ModelLoadError
from backend.models.gguf_export import write_gguf
from backend.models.loader import load_model
from tests.helpers.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("bad") / "llama")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(load_model(tiny_llama), tmp_path_factory.mktemp("badg") / "tiny.gguf")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backend.serving.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def assert_clean_error(done: subprocess.CompletedProcess, path: Path, problem: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert str(path) in lines[0] and problem in lines[0], lines[0]


def write_small_gguf(path: Path, arch: str, setup) -> Path:
    """A GGUF with whatever keys and tensors ``setup(writer)`` adds."""
    w = gguf.GGUFWriter(path, arch)
    setup(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    assert_clean_error(run_cli("generate", "--model", str(missing), "hi"), missing, "no such file")


def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    for cut in (100, len(data) - 1000):  # inside the header; inside the tensor data
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert_clean_error(run_cli("generate", "--model", str(bad), "hi"), bad, "truncated")


def test_unknown_architecture(tmp_path: Path) -> None:
    def setup(w: gguf.GGUFWriter) -> None:
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))

    bad = write_small_gguf(tmp_path / "mamba.gguf", "mamba", setup)
    assert_clean_error(
        run_cli("generate", "--model", str(bad), "hi"), bad, "unknown architecture 'mamba'"
    )


def test_unsupported_quant_type(tmp_path: Path) -> None:
    def setup(w: gguf.GGUFWriter) -> None:
        # IQ3_XXS: 256 values in 98 bytes; a real type, just not one we decode.
        iq3 = gguf.GGMLQuantizationType.IQ3_XXS
        w.add_tensor("token_embd.weight", np.zeros((4, 98), dtype=np.uint8), raw_dtype=iq3)

    bad = write_small_gguf(tmp_path / "iq3.gguf", "llama", setup)
    assert_clean_error(
        run_cli("generate", "--model", str(bad), "hi"), bad, "unsupported quant type IQ3_XXS"
    )


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    assert_clean_error(run_cli("generate", "--model", str(bad), "hi"), bad, "bad magic")


def test_missing_shard(tiny_llama: Path, tmp_path: Path) -> None:
    import transformers

    folder = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.save_pretrained(folder, max_shard_size="40KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    load_model(folder)  # complete: loads
    shards[1].unlink()
    assert_clean_error(
        run_cli("generate", "--model", str(folder), "hi"), folder, f"missing shard {shards[1].name}"
    )


def test_config_tensor_shape_mismatch(tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "mismatch"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(
        run_cli("generate", "--model", str(folder), "hi"),
        folder,
        "has shape [96, 64], but the config implies [128, 64]",
    )


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_corrupt_safetensors_header(tiny_llama: Path, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, folder)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:8] + b"{not json" + st.read_bytes()[17:])
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        load_model(folder)


def test_invalid_sampling_value_is_a_clean_error(tiny_gguf: Path) -> None:
    done = run_cli("generate", "--model", str(tiny_gguf), "--top-p", "1.5", "hi")
    assert (
        done.returncode == 2
        and "top_p must be in (0, 1]" in done.stderr
        and "Traceback" not in done.stderr
    )


def test_bad_metadata_names_the_file(tiny_gguf: Path, tmp_path: Path) -> None:
    def setup(w: gguf.GGUFWriter) -> None:
        w.add_block_count(1)
        w.add_embedding_length(32)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))

    bad = write_small_gguf(tmp_path / "noheads.gguf", "qwen3moe", setup)
    assert_clean_error(
        run_cli("generate", "--model", str(bad), "hi"), bad, "invalid or missing qwen3moe metadata"
    )


def test_models_info(tiny_gguf: Path, tmp_path: Path) -> None:
    done = run_cli("models", "info", str(tiny_gguf))
    assert done.returncode == 0 and "family                     llama" in done.stdout
    missing = tmp_path / "gone.gguf"
    assert_clean_error(run_cli("models", "info", str(missing)), missing, "no such file")


def test_generate_json_schema(tiny_chat_moe: Path, tmp_path: Path) -> None:
    """`bevy generate --json-schema FILE`: the reply is JSON of that schema; a file that is
    not JSON is one clear line naming it."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    args = ("generate", "--model", str(tiny_chat_moe), "--json-schema", str(path))
    done = run_cli(*args, "--max-tokens", "40", "--seed", "1", "Reply in JSON.")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), schema)
    path.write_text("{not json")
    done = run_cli(*args, "x")
    assert_clean_error(done, path, "not a readable JSON schema")


def test_generate_with_tools_prints_content_and_calls(tiny_chat_moe: Path, tmp_path: Path) -> None:
    """`bevy generate --tools FILE`: JSON with the reply's content and its parsed calls (the
    tiny random model rarely calls: the shape is checked, the parsing has its own tests);
    a file that is not a list of tools is one clear line naming it."""
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(tools))
    args = ("generate", "--model", str(tiny_chat_moe), "--tools", str(path))
    done = run_cli(*args, "--max-tokens", "6", "List the files.")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert set(reply) == {"content", "tool_calls"} and isinstance(reply["tool_calls"], list)
    path.write_text('{"not": "a list"}')
    assert_clean_error(run_cli(*args, "x"), path, "tools must be a JSON list")


def test_a_memory_budget_too_small_or_beside_a_cache_is_a_clean_error(
    tiny_chat_moe: Path,
) -> None:
    done = run_cli("serve", "--model", str(tiny_chat_moe), "--memory", "1MiB", "--port", "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "a memory budget of 1 MiB" in done.stderr and "needs at least" in done.stderr
    done = run_cli("serve", "--model", str(tiny_chat_moe), "--memory", "4GiB", "--cache", "0.3")
    assert done.returncode == 2 and "not both" in done.stderr and "Traceback" not in done.stderr
