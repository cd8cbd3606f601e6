"""Tokenizer: GGUF (byte-level BPE and SentencePiece) and HF folders, checked against transformers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import pytest

from backend.errors import ModelLoadError
from backend.text.chat_template import render_chat
from backend.text.tokenizer import Tokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30? Answer in 日本語 🦫"},
    {"role": "assistant", "content": "42 — 四十二"},
    {"role": "user", "content": "Thanks!\n\tBye"},
]
TEXTS = [
    "Hello, world! It's a test they've passed.",
    "12345 3.14159",
    "café naïve Ørsted façade",
    "日本語のテキスト，你好世界",
    "emoji 🦫🎉 family 👩\u200d👩\u200d👧 flag 🇫🇷",
    "  lead\n\n\ttabs\t\t  trail  \r\n",
    "x<|endoftext|>y<|im_start|>user\nhi<|im_end|>\n",
    "",
]


def _metadata(path: Path) -> dict[str, object]:
    """GGUF metadata as plain Python values, the way the loader hands it to Tokenizer."""
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


def _oracle(path: Path):
    """transformers' own conversion of a GGUF's tokenizer (reads the local file only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm_meta(smollm2_gguf: Path) -> dict[str, object]:
    return _metadata(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm(smollm_meta: dict[str, object], smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smollm_meta, smollm2_gguf)


@pytest.fixture(scope="module")
def smollm_oracle(smollm2_gguf: Path):
    return _oracle(smollm2_gguf)


@pytest.fixture(scope="module")
def chat_prompt(smollm: Tokenizer) -> str:
    return render_chat(smollm.chat_template, CHAT, add_generation_prompt=True)


# --- byte-level BPE (SmolLM2 GGUF) -----------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smollm: Tokenizer, text: str) -> None:
    assert smollm.decode(smollm.encode(text)) == text


def test_round_trip_chat_prompt(smollm: Tokenizer, chat_prompt: str) -> None:
    assert smollm.decode(smollm.encode(chat_prompt)) == chat_prompt


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(smollm: Tokenizer, smollm_oracle, text: str) -> None:
    assert smollm.encode(text) == smollm_oracle.encode(text, add_special_tokens=False)


def test_chat_prompt_ids_match_transformers(smollm: Tokenizer, smollm_oracle, chat_prompt) -> None:
    ids = smollm.encode(chat_prompt)
    assert ids == smollm_oracle.encode(chat_prompt, add_special_tokens=False)
    assert ids.count(smollm.token_to_id("<|im_start|>")) == 5


def test_digits_split_first_like_llama_cpp(smollm: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json) isolate every digit before
    # the GPT-2 regex, so "  1" keeps its two spaces as one token. transformers' GGUF conversion
    # skips the digit step and yields "Ġ", "Ġ", "1" here, so this case is checked by hand.
    ids = smollm.encode("a  1 22")
    assert [smollm.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1", "Ġ", "2", "2"]


def test_special_tokens_and_properties(smollm: Tokenizer) -> None:
    start, end = smollm.token_to_id("<|im_start|>"), smollm.token_to_id("<|im_end|>")
    assert smollm.encode("<|im_start|>") == [start] == [1]
    assert smollm.encode("<|im_start|>hi<|im_end|>")[::2] == [start, end]
    assert smollm.decode(smollm.encode("<|im_start|>hi<|im_end|>"), skip_special=True) == "hi"
    assert smollm.vocab_size == 49152
    assert (smollm.bos_id, smollm.eos_ids, smollm.add_bos) == (1, {2}, False)
    assert (smollm.bos_token, smollm.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert smollm.encode("hi", add_special=True) == smollm.encode("hi")  # add_bos_token is false
    assert smollm.chat_template and "<|im_start|>" in smollm.chat_template
    assert smollm.id_to_token(10**6) is None and smollm.token_to_id("no such token") is None


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt2", ["x", "Ġ12345", "Ġ", "Ġ!!"]),
        ("llama-bpe", ["x", "Ġ", "123", "45", "Ġ", "Ġ!!"]),
        ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġ", "Ġ!!"]),
    ],
)
def test_split_regex_by_pre(smollm_meta, smollm2_gguf, pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata({**smollm_meta, "tokenizer.ggml.pre": pre}, smollm2_gguf)
    split = tok.backend.pre_tokenizer.pre_tokenize_str("x 12345  !!")
    assert [piece for piece, _ in split] == pieces


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        # o200k (gpt-oss): a capital starts a new word; a contraction stays with its word.
        ("gpt-4o", ["Hello", "World's", "Ġ", "123", "45", "Ġ", "Ġ!!/Ċ"]),
        ("llama-bpe", ["HelloWorld", "'s", "Ġ", "123", "45", "Ġ", "Ġ!!/Ċ"]),
    ],
)
def test_o200k_split(smollm_meta, smollm2_gguf, pre: str, pieces: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata({**smollm_meta, "tokenizer.ggml.pre": pre}, smollm2_gguf)
    split = tok.backend.pre_tokenizer.pre_tokenize_str("HelloWorld's 12345  !!/\n")
    assert [piece for piece, _ in split] == pieces


def test_unsupported_model(smollm_meta, smollm2_gguf) -> None:
    meta = {**smollm_meta, "tokenizer.ggml.model": "bert"}
    with pytest.raises(ModelLoadError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata(meta, smollm2_gguf)


# --- SentencePiece BPE with byte fallback (Mixtral-style "llama" vocabulary) ------------------

_S = "\u2581"
# (piece, score): SentencePiece joins the adjacent pair whose result scores highest.
_PIECES = [
    (_S, -1.0), ("h", -2.0), ("e", -2.1), ("l", -2.2), ("o", -2.3), ("w", -2.4), ("r", -2.5),
    ("d", -2.6), ("a", -2.7), ("n", -2.8), ("é", -2.9), ("t", -3.0),
    ("ll", -0.1), ("he", -0.2), ("llo", -0.3), ("hello", -0.4), (_S + "hello", -0.5),
    ("or", -0.6), ("orl", -0.7), ("orld", -0.75), ("world", -0.8), (_S + "world", -0.9), ("an", -0.95),
    (_S + "an", -0.96), (_S + _S, -0.97), ("<think>", 0.0),
]  # fmt: skip


def _write_spm_gguf(path: Path, arch: str) -> Path:
    """A tiny GGUF whose tokenizer is a llama.cpp "llama" (SentencePiece) vocabulary."""
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        *(p for p, _ in _PIECES),
    ]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(_PIECES) - 1), 4]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [score for _, score in _PIECES])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(True)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file):
        write()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spm")
    return {arch: _write_spm_gguf(root / f"tiny-{arch}.gguf", arch) for arch in ("llama", "phi3")}


@pytest.fixture(scope="module")
def spm(spm_files) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_metadata(spm_files["llama"]), spm_files["llama"])


@pytest.fixture(scope="module")
def spm_oracles(spm_files) -> dict:
    return {arch: _oracle(path) for arch, path in spm_files.items()}


SPM_TEXTS = ["hello world", "hello  world", "helloworld and hé", "hé€x\n\tok 🦫 日本"]
SPM_SPACED = [" hello", "  hello world  ", "<s>hello</s> world", "an<think>and", "<think>hello"]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_ids_match_transformers(spm: Tokenizer, spm_oracles, text: str) -> None:
    oracle = spm_oracles["llama"]
    assert spm.encode(text) == oracle.encode(text, add_special_tokens=False)
    assert spm.encode(text, add_special=True) == oracle.encode(text)  # BOS added by default


@pytest.mark.parametrize("text", SPM_TEXTS + SPM_SPACED)
def test_spm_ids_match_prefix_normalizer_oracle(spm: Tokenizer, spm_oracles, text: str) -> None:
    # transformers builds "llama" vocabularies with Metaspace(prepend_scheme="first"), which drops
    # a leading space and the dummy prefix after a special token; llama.cpp and SentencePiece keep
    # both. Its phi3 conversion uses the Prepend+Replace normalizer we use, so it is the oracle here.
    oracle = spm_oracles["phi3"]
    assert spm.encode(text) == oracle.encode(text, add_special_tokens=False)


def test_spm_hand_checked(spm: Tokenizer) -> None:
    pieces = [spm.id_to_token(i) for i in spm.encode("<s>hello  world€")]
    assert pieces == ["<s>", _S + "hello", _S, _S + "world", "<0xE2>", "<0x82>", "<0xAC>"]
    assert [spm.id_to_token(i) for i in spm.encode(" hello")] == [_S, _S + "hello"]
    assert (spm.bos_id, spm.eos_ids, spm.add_bos, spm.vocab_size) == (1, {2}, True, 285)


@pytest.mark.parametrize("text", [*SPM_TEXTS, *SPM_SPACED[:2], "\x00\x7f\u0394 ∑"])
def test_spm_round_trip(spm: Tokenizer, text: str) -> None:
    assert spm.decode(spm.encode(text)) == text


# --- Hugging Face folder ---------------------------------------------------------------------


def test_hf_folder(tmp_path: Path, smollm: Tokenizer, smollm_oracle, chat_prompt: str) -> None:
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": "{{ messages }}", "add_bos_token": False})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    for text in [chat_prompt, *TEXTS]:
        assert tok.encode(text) == smollm_oracle.encode(text, add_special_tokens=False)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos, tok.eos_token) == (1, {0, 2}, False, "<|im_end|>")
    assert tok.chat_template == "{{ messages }}"
    (tmp_path / "chat_template.jinja").write_text("jinja file wins")
    assert Tokenizer.from_hf_folder(tmp_path).chat_template == "jinja file wins"


def test_hf_folder_without_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json") as info:
        Tokenizer.from_hf_folder(tmp_path)
    assert info.value.path == tmp_path / "tokenizer.json"


# --- streaming detokenization ----------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    decoder = tok.stream_decoder(skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


@pytest.mark.parametrize("skip_special", [False, True])
def test_stream_decoder_byte_level(smollm: Tokenizer, chat_prompt: str, skip_special) -> None:
    for text in [chat_prompt, *TEXTS]:
        ids = smollm.encode(text)
        pieces = _stream(smollm, ids, skip_special)
        assert "".join(pieces) == smollm.decode(ids, skip_special=skip_special)
        assert not any("\ufffd" in piece for piece in pieces)
    # A 4-byte emoji is split over byte tokens: nothing comes out until it is whole.
    ids = smollm.encode("🦫")
    assert len(ids) > 1 and _stream(smollm, ids)[-2:] == ["🦫", ""]


def test_stream_decoder_sentencepiece(spm: Tokenizer) -> None:
    for text in ["hello world  and 🦫 日本", " hello", "<s>hello</s> world"]:
        ids = spm.encode(text, add_special=True)
        for skip in (False, True):
            pieces = _stream(spm, ids, skip)
            assert "".join(pieces) == spm.decode(ids, skip_special=skip)
            assert not any("\ufffd" in piece for piece in pieces)
    assert _stream(spm, spm.encode("hello world"))[:-1] == ["hello", " world"]


def test_stream_decoder_flush_emits_incomplete_tail(smollm: Tokenizer) -> None:
    ids = smollm.encode("ok 🦫")[:-1]  # the emoji's last byte never arrives
    pieces = _stream(smollm, ids)
    assert "".join(pieces) == smollm.decode(ids) and pieces[-1].endswith("\ufffd")


@pytest.mark.parametrize(("pre", "first"), [("qwen35", (0, 5)), ("qwen2", (0, 4))])
def test_qwen35_split_keeps_combining_marks_in_words(
    smollm_meta, smollm2_gguf, pre: str, first: tuple[int, int]
) -> None:
    tok = Tokenizer.from_gguf_metadata({**smollm_meta, "tokenizer.ggml.pre": pre}, smollm2_gguf)
    split = tok.backend.pre_tokenizer.pre_tokenize_str("cafe\u0301! 7")
    assert split[0][1] == first


def test_gemma4_vocab_tokenizes_as_llama_cpp() -> None:
    """llama.cpp's ``gemma4`` tokenizer model (BPE over raw UTF-8, spaces as ``▁``, merges
    within each line and each run of newlines, byte fallback) on its own test cases for
    Gemma 4's vocabulary; the ends of a turn and of a tool call stop generation."""
    from backend.formats.gguf import read_gguf
    from tests.helpers.llama_vocab import cases, llama_cpp_vocab

    vocab = llama_cpp_vocab("gemma-4")
    tok = Tokenizer.from_gguf_metadata(read_gguf(vocab).metadata, vocab)
    checked = cases(vocab)
    assert len(checked) > 40
    for text, ids in checked:
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text, text
    assert tok.add_bos and tok.encode("Hi", add_special=True)[0] == tok.bos_id == 2
    ends = {tok.token_to_id(t) for t in ("<eos>", "<turn|>", "<|tool_response>")}
    assert tok.eos_ids == ends
    turn = tok.encode("<|turn>user\nhi<turn|>")  # control tokens whole, as the template writes
    assert turn[0] == tok.token_to_id("<|turn>") and turn[-1] == tok.token_to_id("<turn|>")
    assert turn[2] == tok.token_to_id("\n") and len(turn) == 5
