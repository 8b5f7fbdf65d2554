"""`mpsd init-model NAME --openai embeddings|chat --from FOLDER`: a Hugging Face model folder (what
`save_pretrained` writes: config.json, the weights, the tokenizer; a chat model's tokenizer with its chat
template) becomes a python model that serves OpenAI's `/v1/embeddings` or `/v1/chat/completions`.

The folder is copied into the version folder (`1/hf/`), beside a `model.py` written from a template the user
may edit: sentence embeddings as the folder's sentence-transformers configuration says (its max_seq_length,
pooling and normalization; a plain folder: mean-pooled, unit length); or token-by-token generation (a
decoupled model) that applies the chat template and OpenAI's `max_tokens`, `temperature`, `top_p`, `stop`
and `seed`. The model is checked with the worker's own loading and warm-up before it is moved into place,
as every model `init-model` writes. transformers must be installed where the model runs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from mpsd.config.repository import CONFIG_FILE
from mpsd.tools.common import ToolError
from mpsd.tools.init_model import check_new, staged

TASKS = ("embeddings", "chat")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim")

EMBEDDINGS_MODEL = '''"""Written by `mpsd init-model --openai embeddings`: sentence embeddings from the
Hugging Face model in hf/, for OpenAI's /v1/embeddings (docs/openai.md). A folder sentence-transformers
saved is followed as sentence-transformers runs it: texts cut at its max_seq_length
(sentence_bert_config.json), pooled as its Pooling module says (1_Pooling/config.json) and scaled to unit
length only with a Normalize module (modules.json). Any other folder: mean pooling over at most the
model's positions, scaled to unit length. Edit freely: the daemon gives TEXT (one text per row) and reads
EMBEDDING and TOKENS (each text's tokens)."""

import json
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

MODULES = "sentence_transformers.models."
# Pooling modes in the order sentence-transformers concatenates them.
MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def settings(folder):
    """max_seq_length (None: the model's), lower-casing, the pooling modes and whether to normalize."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, False, ["mean_tokens"], True
    st_file = folder / "sentence_bert_config.json"
    st = json.loads(st_file.read_text()) if st_file.is_file() else {}
    modes, normalize = ["mean_tokens"], False
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "")
        if kind == MODULES + "Pooling":
            pooling = json.loads((folder / module["path"] / "config.json").read_text())
            modes = [m for m in MODES if pooling.get("pooling_mode_" + m)]
        elif kind == MODULES + "Normalize":
            normalize = True
        elif kind != MODULES + "Transformer":
            raise ValueError(f"modules.json names {kind!r} ({module.get('path')}): this model.py runs "
                             "Transformer, Pooling and Normalize modules only; edit it to run the others")
    return st.get("max_seq_length"), bool(st.get("do_lower_case")), modes, normalize


def pool(hidden, mask, modes):
    """Each mode's vector over the tokens that are not padding, concatenated."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    summed, count = (hidden * weights).sum(1), weights.sum(1).clamp(min=1e-9)
    positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)
    vectors = {
        "cls_token": lambda: hidden[:, 0],
        "max_tokens": lambda: hidden.masked_fill(weights == 0, -1e9).max(1).values,
        "mean_tokens": lambda: summed / count,
        "mean_sqrt_len_tokens": lambda: summed / count.sqrt(),
        "weightedmean_tokens": lambda: (hidden * weights * positions[None, :, None]).sum(1)
        / (weights * positions[None, :, None]).sum(1).clamp(min=1e-9),
        "lasttoken": lambda: hidden[torch.arange(hidden.shape[0]), (mask * positions).argmax(1)],
    }
    return torch.cat([vectors[mode]() for mode in modes], dim=1)


class Model:
    def __init__(self, config, device):
        folder = Path(config["model_path"]).parent / "hf"
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.network = AutoModel.from_pretrained(folder).to(device).eval()
        longest, self.lower, self.modes, self.normalize = settings(folder)
        limit = self.tokenizer.model_max_length
        positions = getattr(self.network.config, "max_position_embeddings", None) or limit
        self.max_length = longest or min(limit, positions)

    def infer(self, inputs):
        texts = [t.decode("utf-8", "replace").strip() for t in inputs["TEXT"].reshape(-1)]
        if self.lower:
            texts = [t.lower() for t in texts]
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.network(**batch).last_hidden_state
        embedding = pool(hidden, batch["attention_mask"], self.modes).float()
        if self.normalize:
            embedding = torch.nn.functional.normalize(embedding, dim=1)
        tokens = batch["attention_mask"].sum(1, keepdim=True).to(torch.int64)
        return {"EMBEDDING": embedding, "TOKENS": tokens}
'''

CHAT_MODEL = '''"""Written by `mpsd init-model --openai chat`: a chat model from the Hugging Face causal
language model in hf/, for OpenAI's /v1/chat/completions (docs/openai.md). It applies the tokenizer's chat
template to the messages and yields one response per token (a decoupled model), reading OpenAI's
max_tokens (or max_completion_tokens), temperature (0: greedy), top_p, stop and seed from the request's
parameters. Edit freely."""

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _strings(value):
    return np.array([value.encode()], dtype=object)


def _stops(value):
    """OpenAI's `stop`: one string, or a list of them, which arrives as its JSON text."""
    if not value:
        return []
    if value.startswith("["):
        try:
            return [str(s) for s in json.loads(value)]
        except ValueError:
            pass
    return [value]


class Model:
    def __init__(self, config, device):
        folder = Path(config["model_path"]).parent / "hf"
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.network = AutoModelForCausalLM.from_pretrained(folder).to(device).eval()

    def _next(self, logits, temperature, top_p, generator):
        if temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:
            ordered, order = probs.sort(descending=True)
            keep = ordered.cumsum(0) - ordered < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    def infer(self, inputs, parameters):
        text = inputs["MESSAGES"].reshape(-1)[0].decode("utf-8", "replace")
        params = parameters
        if not text:
            return  # warm-up: no messages, no responses
        messages = json.loads(text)
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        encoded = self.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        ids = encoded["input_ids"].to(self.device)
        limit = int(params.get("max_completion_tokens") or params.get("max_tokens") or 256)
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        stop = _stops(params.get("stop"))
        generator = torch.Generator()
        if params.get("seed") is not None:
            generator.manual_seed(int(params["seed"]))
        else:
            generator.seed()
        hold = max((len(s) for s in stop), default=1) - 1  # text that may begin a stop string waits
        tokens, shown, past, current, finish = [], 0, None, ids, "length"
        for _ in range(limit):
            with torch.inference_mode():
                out = self.network(input_ids=current, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = self._next(out.logits[0, -1].float().cpu(), temperature, top_p, generator)
            if token == self.tokenizer.eos_token_id:
                finish = "stop"
                break
            tokens.append(token)
            current = torch.tensor([[token]], device=self.device)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                yield self._out(text[shown:cut], "stop", ids.shape[1], len(tokens))
                return
            safe = len(text) - hold - (1 if text.endswith("\ufffd") else 0)  # a character's first bytes wait
            if safe > shown:
                yield self._out(text[shown:safe], "", ids.shape[1], len(tokens))
                shown = safe
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        yield self._out(text[shown:], finish, ids.shape[1], len(tokens))

    def _out(self, piece, finish, prompt, completion):
        return {
            "TEXT": _strings(piece),
            "FINISH": _strings(finish),
            "USAGE": torch.tensor([prompt, completion], dtype=torch.int64),
        }
'''


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _hidden_size(folder: Path) -> int:
    """The embeddings' size from the model's config.json; -1 (any) where it does not say."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(
            f"{folder}/config.json cannot be read: {exc}",
            "give the folder a Hugging Face model was saved to (save_pretrained)",
        ) from None
    for key in HIDDEN_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return int(config[key])
    return -1


def _embedding_size(folder: Path) -> int:
    """The embeddings' size: a sentence-transformers Pooling module's dimension once per pooling mode it
    concatenates (1_Pooling/config.json), else the model's hidden size."""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = next(m for m in modules if m.get("type") == "sentence_transformers.models.Pooling")
        config = json.loads((folder / pooling["path"] / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
        return _hidden_size(folder)
    modes = sum(1 for key, on in config.items() if key.startswith("pooling_mode_") and on is True)
    width = config.get("word_embedding_dimension")
    return int(width) * modes if isinstance(width, int) and width > 0 and modes else _hidden_size(folder)


def config_text(name: str, task: str, folder: Path) -> str:
    string = "{data_type: TYPE_STRING, dims: [1]}"
    head = [
        f"# Written by `mpsd init-model --openai {task}` from {folder.name}: the Hugging Face model is in",
        "# 1/hf/, model.py runs it. Reference: docs/configuration.md, docs/openai.md",
        f"name: {name}",
        "backend: python",
    ]
    if task == "embeddings":
        body = [
            "max_batch_size: 32",
            "dynamic_batching: {max_queue_delay_microseconds: 1000}",
            "input:",
            f"  - {{name: TEXT, {string[1:]}",
            "output:",
            f"  - {{name: EMBEDDING, data_type: TYPE_FP32, dims: [{_embedding_size(folder)}]}}",
            "  - {name: TOKENS, data_type: TYPE_INT64, dims: [1]}",
            "instance_group: [{kind: KIND_AUTO, count: 1}]",
            "openai: {task: embeddings, input: TEXT, output: EMBEDDING, usage_output: TOKENS}",
        ]
    else:
        body = [
            "max_batch_size: 0",
            "model_transaction_policy: {decoupled: true}",
            "input:",
            f"  - {{name: MESSAGES, {string[1:]}",
            "output:",
            f"  - {{name: TEXT, {string[1:]}",
            f"  - {{name: FINISH, {string[1:]}",
            "  - {name: USAGE, data_type: TYPE_INT64, dims: [2]}",
            "instance_group: [{kind: KIND_AUTO, count: 1}]",
            "openai:",
            "  task: chat",
            "  input: MESSAGES",
            "  parameters: true",
            "  output: TEXT",
            "  finish_reason_output: FINISH",
            "  usage_output: USAGE",
        ]
    return "\n".join(head + body) + "\n"


def run(name: str, task: str, folder: Path, repo: Path, version: int) -> int:
    if task not in TASKS:
        raise ToolError(
            f"--openai {task} is not a task init-model writes", f"choose one of {', '.join(TASKS)}"
        )
    check_new(repo, name, version)
    if not (folder / "config.json").is_file():
        raise ToolError(
            f"{folder} is not a Hugging Face model folder (no config.json)",
            "give the folder a model and its tokenizer were saved to (save_pretrained)",
        )
    text = config_text(name, task, folder)
    source = EMBEDDINGS_MODEL if task == "embeddings" else CHAT_MODEL

    def fill(version_dir: Path) -> None:
        _progress(f"copying {folder} into {name}/{version}/hf")
        shutil.copytree(folder, version_dir / "hf")
        (version_dir / "model.py").write_text(source)

    repo.mkdir(parents=True, exist_ok=True)
    written = staged(repo, name, version, text, fill)
    print(text, end="")
    endpoint = "/v1/embeddings" if task == "embeddings" else "/v1/chat/completions"
    _progress(
        f"wrote {written}/{CONFIG_FILE} and {written}/{version}/; a daemon watching {repo} loads it now "
        f"(otherwise `mpsd reload`). Try: POST {endpoint} with model '{name}' (docs/openai.md)"
    )
    return 0
