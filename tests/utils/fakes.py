"""Test doubles: a model runner without a model, and a tiny trained tokenizer."""
from __future__ import annotations

from pathlib import Path

from kiln.runtime.scheduler import RunnerOutput, SchedulerOutput, TokenResult


def fake_token(seq_id: int, num_tokens: int) -> int:
    """The token FakeRunner samples for a sequence that holds ``num_tokens`` tokens."""
    return (seq_id * 7 + num_tokens) % 50 + 3


class FakeRunner:
    """Stands in for ModelRunner: records every chunk and 'samples' a deterministic token.

    ``calls`` holds one list per step of ``(seq_id, start, num_tokens)``, where ``start`` is
    the sequence's ``num_computed_tokens`` when the step ran.
    """

    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int, int]]] = []

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.calls.append([(c.seq.seq_id, c.seq.num_computed_tokens, c.num_tokens) for c in out.chunks])
        return RunnerOutput(tokens={c.seq.seq_id: TokenResult(fake_token(c.seq.seq_id, c.seq.num_tokens))
                                    for c in out.chunks if c.completes})


TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, how are you today?",
    "kiln builds engines from checkpoints and runs them",
    "a tiny model speaks random words very quickly",
    "the cat sat on the mat and the dog sat on the log",
    "numbers 0 1 2 3 4 5 6 7 8 9 and letters too",
]

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tiny_tokenizer(vocab_size: int = 256):
    """A BPE tokenizer (Metaspace, like SentencePiece) trained on a few sentences.

    Special tokens: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 (the ids tiny_models configs use), ``<unk>`` 3.
    Carries a simple chat template. Returns a ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_llama_with_tokenizer(path: Path, **llama_kwargs):
    """A tiny random Llama in ``path`` with a tiny tokenizer saved next to it (vocab sizes match).

    Returns ``(hf_model, tokenizer)``.
    """
    from tests.utils.tiny_models import make_llama

    tokenizer = make_tiny_tokenizer()
    model = make_llama(Path(path), vocab=len(tokenizer), **llama_kwargs)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def llama_config(hidden: int, heads: int, kv_heads: int, head: int, inter: int, layers: int, tp_size: int = 1):
    """A kiln config of a Llama of these sizes (no weights anywhere): for code that only reads a
    model's shapes, such as LoRA adapter checks."""
    from kiln.mapping import Mapping
    from kiln.models.llama import LlamaForCausalLM

    hf = dict(architectures=["LlamaForCausalLM"], hidden_size=hidden, num_attention_heads=heads,
              num_key_value_heads=kv_heads, head_dim=head, intermediate_size=inter, num_hidden_layers=layers,
              vocab_size=32, rms_norm_eps=1e-5, max_position_embeddings=64)
    return LlamaForCausalLM.config_from_hf(hf, "float32", Mapping(tp_size=tp_size, world_size=tp_size))
