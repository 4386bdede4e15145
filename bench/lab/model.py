"""The lab's model, built locally (no model hub): a small Llama with random weights and a
word-level tokenizer trained offline on generated text.

Run by the engines' interpreter (it has torch, transformers and tokenizers):
``python bench/lab/model.py OUT``. The words are the ones ``words()`` makes, so the lab's own
driver turns a prompt into the engine's token ids without the tokenizers library: one id
per space-separated word, looked up in the trained tokenizer's table (``token_ids``;
tests/test_lab_engines.py checks it against the engine's own ``/tokenize``).
Random weights are enough: prefix caching and KV events are the engine's own either way.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIALS = ("<unk>", "<s>", "</s>")
VOCAB_WORDS = 2000
_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "ze",
    "pa",
    "di",
    "go",
    "ha",
    "ju",
    "be",
    "fo",
)


def words() -> list[str]:
    """The words of the lab's texts and of its tokenizer, deterministic."""
    rng = random.Random(7)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < VOCAB_WORDS:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def vocabulary(model_dir: Path) -> dict[str, int]:
    """The trained tokenizer's word -> id table, read from the built model's tokenizer.json."""
    data = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    return vocab


def token_ids(text: str, vocab: dict[str, int]) -> list[int]:
    """The engine's token ids for ``text``: one per space-separated word, no BOS added."""
    return [vocab[word] for word in text.split()]


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = words()
    # Train the word-level model offline on generated text that holds every word.
    text = [" ".join(vocab[i : i + 40]) for i in range(0, len(vocab), 40)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        special_tokens=list(SPECIALS), min_frequency=1, vocab_size=len(SPECIALS) + len(vocab)
    )
    tokenizer.train_from_iterator(text, trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(SPECIALS) + len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
