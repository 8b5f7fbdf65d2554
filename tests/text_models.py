"""A real text model for the tests that serve strings: a WordPiece tokenizer trained here with `tokenizers`
and a small BERT (random weights from a `transformers` config) inside a python model that takes sentences
and returns mean-pooled embeddings. The same code also runs in the test's process, as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests import models

HIDDEN = 32
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a model server for pytorch on apple silicon",
    "strings in, embeddings out, batched by the daemon",
    "tokenizers train a vocabulary from a small corpus",
] * 8

# Shared by the served model and the in-process reference: the tokenizer and the network are the
# model's files, read from the folder they are given. `tokens` counts each text's tokens.
EMBED = """
import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import BertModel


class Embedder:
    def __init__(self, folder):
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.network = BertModel.from_pretrained(str(folder)).eval()

    def encode(self, texts):
        encoded = self.tokenizer.encode_batch([t.decode("utf-8") for t in texts])
        ids = torch.tensor([e.ids for e in encoded], dtype=torch.long)
        mask = torch.tensor([e.attention_mask for e in encoded], dtype=torch.long)
        return ids, mask

    def tokens(self, texts):
        return self.encode(texts)[1].sum(1)

    def __call__(self, texts):
        ids, mask = self.encode(texts)
        with torch.inference_mode():
            hidden = self.network(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
"""
MODEL_BODY = """
texts = inputs['TEXT'].reshape(-1)
return {'EMBEDDING': self.embed(texts)}
"""
# The model imports its own helper from its folder and builds it once, at load.
_LOAD_HELPER = (
    "        self.device = device\n"
    "        import importlib.util, pathlib\n"
    "        folder = pathlib.Path(config['model_path']).parent\n"
    "        spec = importlib.util.spec_from_file_location('embed', folder / 'embed.py')\n"
    "        module = importlib.util.module_from_spec(spec)\n"
    "        spec.loader.exec_module(module)\n"
    "        self.embed = module.Embedder(folder)\n"
)


def build(folder: Path) -> None:
    """The tokenizer (trained on CORPUS) and the network (random weights, fixed seed) in `folder`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import models as tok_models
    from transformers import BertConfig, BertModel

    tokenizer = Tokenizer(tok_models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(str(folder))


def embedder(repo: Path, name: str, config: dict[str, Any], body: str = MODEL_BODY) -> Path:
    """A python model `name` in `repo` whose `infer` (`body`) has `self.embed`, the Embedder built from its
    version folder; returns that folder."""
    folder = models.python_model(repo, name, body, config=config) / "1"
    build(folder)
    (folder / "embed.py").write_text(EMBED)
    source = (folder / "model.py").read_text()
    (folder / "model.py").write_text(source.replace("        self.device = device\n", _LOAD_HELPER))
    return folder


def reference(folder: Path, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The embeddings of each sentence on its own, and its token count, computed in this process."""
    namespace: dict[str, object] = {}
    exec(compile(EMBED, "embed.py", "exec"), namespace)
    embed: Any = namespace["Embedder"](folder)  # type: ignore[operator]
    vectors = np.stack([embed([s.encode()])[0].numpy() for s in sentences])
    counts = np.array([int(embed.tokens([s.encode()])[0]) for s in sentences])
    return vectors, counts


def for_auto_classes(folder: Path) -> None:
    """The folder `build` wrote, loadable by transformers' AutoTokenizer too (tokenizer_config.json)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    special = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]"}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(str(folder))


def causal_lm(folder: Path) -> None:
    """A small GPT-2 (random weights, fixed seed) and a word-level tokenizer trained on CORPUS, with a chat
    template, saved as a Hugging Face model folder."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(tok_models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(
        CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<s> assistant :{% endif %}"
    )
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(fast),
        n_positions=256,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    network = GPT2LMHeadModel(config)
    with torch.no_grad():  # special tokens score 0 (the head shares these rows): the model says words
        network.transformer.wte.weight[: len(fast.all_special_ids)] = 0
    network.save_pretrained(str(folder))
