"""A tiny byte-level BPE tokenizer (300 ids, any text encodes), for tiny models that need text."""
from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 300
CORPUS = [
    "Summarize the following article. The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token; perplexity measures how well it does.",
    "The engine converts checkpoints, builds engines and runs them fast on a CPU.",
]


def save_tiny_tokenizer(directory: Path) -> int:
    """Train the tokenizer on a few sentences, save it (tokenizer.json + config) to
    ``directory`` with ``<s>`` (id 0) and ``</s>`` (id 1); returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"], show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(str(directory))
    return len(fast)
