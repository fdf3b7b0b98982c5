"""A tiny local Llama model directory for CPU serving: no hub, no weights.

``make_tiny_model_dir`` writes ``config.json`` (a Llama with tiny dimensions),
a ``tokenizers`` WordLevel ``tokenizer.json`` (whitespace words, deterministic
vocabulary), ``tokenizer_config.json`` with a chat template, and
``generation_config.json``. vLLM reads the config and the tokenizer from it;
with the stub executor no weights are ever loaded (``--load-format dummy``).

``make_document`` writes text made only of vocabulary words, so every word is
one token and prompt lengths are predictable (tests size prefixes in blocks).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TinyModelSpec", "make_document", "make_tiny_model_dir", "vocabulary"]

_SPECIALS = ("<unk>", "<s>", "</s>")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "s", "l")
#: Words every prompt in the tests and the demo may use, besides generated ones.
_COMMON = (  # noqa: SIM905 - one readable string
    "the of and to in is it that was for on are with as be at by this had not "
    "but from or have an they which one you were all we when there can what "
    "question answer document section page memory cache engine limit request "
    "who why how where does summary first second third fourth model token "
    "user assistant system"
).split()


_DEFAULT_VOCAB_WORDS = 4000


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Dimensions of the tiny model (what vLLM sizes the KV cache from)."""

    num_layers: int = 2  # attention layers: each gets a K and a V region
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_words: int = _DEFAULT_VOCAB_WORDS  # generated words after the specials and common words
    max_position_embeddings: int = 8192

    @property
    def hidden_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def vocabulary(num_words: int = _DEFAULT_VOCAB_WORDS) -> list[str]:
    """The deterministic vocabulary: specials, common words, then syllable words."""
    words: list[str] = list(_SPECIALS)
    seen = set(words)
    for word in _COMMON:
        if word not in seen:
            seen.add(word)
            words.append(word)
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    for first in syllables:
        for second in syllables:
            if len(words) >= len(_SPECIALS) + len(_COMMON) + num_words:
                return words
            word = first + second
            if word not in seen:
                seen.add(word)
                words.append(word)
    return words


def make_document(num_words: int, *, seed: int = 0) -> str:
    """``num_words`` vocabulary words (one token each), deterministic for ``seed``."""
    if num_words < 0:
        raise ValueError(f"num_words must be >= 0; got {num_words}")
    words = vocabulary()[len(_SPECIALS) :]
    rng = random.Random(seed)
    return " ".join(rng.choice(words) for _ in range(num_words))


def make_tiny_model_dir(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a servable tiny Llama model directory at ``path`` and return it.

    Idempotent: rewriting the same spec produces identical files.
    """
    spec = spec or TinyModelSpec()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    words = vocabulary(spec.vocab_words)
    _write_json(out / "config.json", _config(spec, len(words)))
    _write_json(out / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    _write_tokenizer(out / "tokenizer.json", words)
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    return out


def _config(spec: TinyModelSpec, vocab_size: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": 2 * spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_kv_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _write_tokenizer(path: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {word: idx for idx, word in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(path))


def _tokenizer_config() -> dict[str, object]:
    template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}answer {% endif %}"
    )
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }


def _write_json(path: Path, data: dict[str, object]) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
