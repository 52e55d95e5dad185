"""GGUF files of tiny Hugging Face checkpoints written by llama.cpp's own converter.

``convert_with_llama_cpp`` runs ``convert_hf_to_gguf.py`` from the pinned llama-cpp-python
sdist (``tests/utils/fetch_llama_cpp_converter.py`` puts it in ``.venv/llama.cpp-convert``
and is run here when it is missing) with the converter's bundled ``gguf-py``, not the
``gguf`` package kiln uses (``convert_many_with_llama_cpp``: several models in one converter
process). ``save_converter_tokenizer`` gives a model directory a tokenizer the converter accepts,
which it needs for every architecture; ``save_sentencepiece_tokenizer`` the sentencepiece model
the converters of ERNIE 4.5 (and other sentencepiece-only families) read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.utils import fetch_llama_cpp_converter
from tests.utils.tiny_tokenizer import CORPUS

# GPT-2's vocabulary (50,256 byte-level BPE tokens and <|endoftext|>).
GPT2_VOCAB = 50257
# Converter classes whose set_vocab (LlamaModel's; Gemma 4's LlamaHfVocab) takes a Llama-2 style
# tokenizer.json (BPE with byte fallback) as it is, with no pre-tokenizer hash; the others only
# know GPT-2 style BPE tokenizers by that hash (or need a sentencepiece tokenizer.model).
LLAMA_VOCAB_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "ArceeForCausalLM", "Gemma4ForCausalLM"})
_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as in Llama 2 (and tiny_models' config)
_ALPHABET = ["\u2581", *map(chr, range(0x21, 0x7F))]  # "▁" (a space) and printable ASCII
LLAMA_MIN_VOCAB = len(_SPECIALS) + len(_ALPHABET)


def converter_dir() -> Path:
    """The converter's directory, fetched first if it is missing or of another version."""
    dest = fetch_llama_cpp_converter.DEFAULT_DEST
    if not fetch_llama_cpp_converter.is_current(dest, fetch_llama_cpp_converter.pinned_version()):
        fetch_llama_cpp_converter.fetch(dest=dest)  # from PyPI, as `make install` does
    return dest


def converter_env(conv: Path | None = None) -> dict[str, str]:
    """The environment the converter runs in: its own gguf-py first on the path (the script
    also puts it there, unless NO_LOCAL_GGUF is set, which is dropped), its sentencepiece, and
    the Hugging Face hub kept offline."""
    conv = conv or converter_dir()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    paths = [conv / "gguf-py", conv / "deps"]
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    return env


def convert_with_llama_cpp(hf_dir: Path, out_file: Path, outtype: str = "f32") -> Path:
    """Convert the Hugging Face checkpoint in ``hf_dir`` (with a tokenizer the converter accepts:
    ``save_converter_tokenizer``) to ``out_file`` with llama.cpp's ``convert_hf_to_gguf.py``;
    ``outtype`` is its ``--outtype`` (f32, f16, bf16, q8_0, ...). Returns ``out_file``."""
    conv = converter_dir()
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(conv / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out_file),
           "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=converter_env(conv))
    if proc.returncode or not out_file.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed ({proc.returncode}) on {hf_dir}:\n{tail}")
    return out_file


# Runs the converter's main() once per job in one process: importing the converter (torch,
# transformers) costs ~2 s of the ~3 s a tiny model's conversion takes.
_BATCH = """
import json, sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for hf_dir, out_file, outtype, *options in json.loads(sys.argv[2]):
    print(f"converting {hf_dir}", file=sys.stderr)
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out_file, "--outtype", outtype, *options]
    convert_hf_to_gguf.main()
"""


def convert_many_with_llama_cpp(jobs: list[tuple]) -> list[Path]:
    """``convert_with_llama_cpp`` for each (hf_dir, out_file, outtype, *converter options) of
    ``jobs`` (Qwen3.5 without MTP layers: ``"--no-mtp"``), in one converter process; returns the
    out files."""
    conv = converter_dir()
    for _, out_file, *_ in jobs:
        Path(out_file).parent.mkdir(parents=True, exist_ok=True)
    spec = json.dumps([[str(d), str(o), t, *options] for d, o, t, *options in jobs])
    proc = subprocess.run([sys.executable, "-c", _BATCH, str(conv), spec], capture_output=True, text=True,
                          env=converter_env(conv))
    missing = [str(o) for _, o, *_ in jobs if not Path(o).is_file()]
    if proc.returncode or missing:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed ({proc.returncode}; missing {missing}):\n{tail}")
    return [Path(o) for _, o, *_ in jobs]


def save_converter_tokenizer(hf_dir: Path, vocab_size: int) -> int:
    """Save to ``hf_dir`` a tokenizer llama.cpp's converter accepts for a model of ``vocab_size``
    tokens; returns the tokenizer's length (at most ``vocab_size``: the converter fills the
    remaining ids with ``[PAD<i>]`` tokens). Save the model first: its config.json decides.

    - ``vocab_size >= GPT2_VOCAB`` (50,257): GPT-2's own tokenizer, rebuilt from the vocabulary
      file llama.cpp ships (models/ggml-vocab-gpt-2.gguf). Its pre-tokenizer hash is one the
      converter knows ("gpt-2"), so this works for every architecture. (Gemma 3's converter
      keeps only the tokenizer's rows of the embedding: give Gemma 3 exactly 50,257.)
    - otherwise, only for ``LLAMA_VOCAB_ARCHITECTURES`` and ``vocab_size >= LLAMA_MIN_VOCAB``
      (98): a small Llama-2 style BPE with byte fallback (<unk> <s> </s> = 0 1 2, "▁" for
      spaces, printable ASCII, merges trained on a few sentences; the 256 <0xXX> byte tokens
      too once ``vocab_size`` leaves room), which the converter reads without a hash.

    Any other architecture with fewer than 50,257 tokens cannot be converted: the converter
    refuses a BPE tokenizer whose token ids for its check text it does not know, and those ids
    are a real tokenizer's (GPT-2's largest is 48,101)."""
    hf_dir = Path(hf_dir)
    config = hf_dir / "config.json"
    arch = (json.loads(config.read_text()).get("architectures") or [None])[0] if config.is_file() else None
    if vocab_size >= GPT2_VOCAB:
        return _save_gpt2_tokenizer(hf_dir)
    if arch is not None and arch not in LLAMA_VOCAB_ARCHITECTURES:
        raise ValueError(f"llama.cpp's converter takes {arch} with GPT-2's tokenizer only: a vocab_size of at least "
                         f"{GPT2_VOCAB} (not {vocab_size})")
    if vocab_size < LLAMA_MIN_VOCAB:
        raise ValueError(f"the Llama-style converter tokenizer needs a vocab_size of at least {LLAMA_MIN_VOCAB}")
    return _save_llama_tokenizer(hf_dir, vocab_size)


_SENTENCEPIECE = """
import io, json, sys
import sentencepiece
model = io.BytesIO()
sentencepiece.SentencePieceTrainer.train(
    sentence_iterator=iter(json.loads(sys.argv[2])), model_writer=model, vocab_size=int(sys.argv[3]), model_type="bpe",
    hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
open(sys.argv[1], "wb").write(model.getvalue())
"""


def save_sentencepiece_tokenizer(hf_dir: Path, vocab_size: int) -> Path:
    """Write ``hf_dir/tokenizer.model``: a sentencepiece BPE of at most ``vocab_size`` pieces
    (<unk> <s> </s> = 0 1 2) trained on a few sentences, for the converters that read only a
    sentencepiece model (ERNIE 4.5's). sentencepiece comes with the converter's dependencies."""
    out = Path(hf_dir) / "tokenizer.model"
    subprocess.run([sys.executable, "-c", _SENTENCEPIECE, str(out), json.dumps(CORPUS * 4), str(vocab_size)],
                   check=True, capture_output=True, env=converter_env())
    return out


def _save_gpt2_tokenizer(directory: Path) -> int:
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(converter_dir() / "models" / "ggml-vocab-gpt-2.gguf").fields

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    assert len(tokens) == GPT2_VOCAB and tokens[-1] == "<|endoftext|>"
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    end = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=end, eos_token=end, unk_token=end)
    fast.save_pretrained(str(directory))
    return len(fast)


def _save_llama_tokenizer(directory: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if vocab_size >= LLAMA_MIN_VOCAB + 256 else []
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = BpeTrainer(vocab_size=vocab_size - len(byte_tokens), special_tokens=_SPECIALS,
                         initial_alphabet=_ALPHABET, limit_alphabet=len(_ALPHABET), show_progress=False)
    trained.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(trained.to_str())["model"]
    # Llama 2's order: the special tokens, the byte tokens, then the pieces.
    pieces = sorted((t for t in model["vocab"] if t not in _SPECIALS), key=model["vocab"].get)
    vocab = {t: i for i, t in enumerate([*_SPECIALS, *byte_tokens, *pieces])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))
    assert len(fast) <= vocab_size
    return len(fast)
