"""MMCA (Wei et al. 2020): a self-attention module per modality (regions through a Transformer unit, WordPiece
tokens through a frozen BERT-like encoder and a phrase CNN) and a cross-attention module over every pair's
stacked regions and words; the three-term loss of Eq. 15. docs/mmca.md."""

from __future__ import annotations

from itmatch.config import ModelConfig
from itmatch.data.vocab import AnyVocab, WordPieceVocab
from itmatch.errors import ConfigError
from itmatch.models.base import Matcher
from itmatch.models.mmca.config import MMCAConfig
from itmatch.models.mmca.encoders import FrozenTransformer, MMCAImageEncoder, MMCATextEncoder
from itmatch.models.mmca.head import MMCAHead
from itmatch.models.registry import Arch, Preset, register_arch, register_presets

__all__ = ["FrozenTransformer", "MMCAConfig", "MMCAHead", "MMCAImageEncoder", "MMCATextEncoder"]


@register_arch
class MMCA(Arch):
    name = "mmca"
    norm_keys = ()  # (model.img_norm / txt_norm: registry.Arch.norm_keys)

    def tokenizer(self, mc: ModelConfig) -> AnyVocab | None:
        """The WordPiece tokenizer of the frozen text encoder (data.tokenizer=wordpiece)."""
        return WordPieceVocab.from_pretrained(mc.mmca.text_model, mc.mmca.max_tokens)

    def build(self, mc: ModelConfig) -> Matcher:
        from itmatch.features.text_backbone import load_pretrained_encoder

        c = mc.mmca
        encoder = FrozenTransformer(load_pretrained_encoder(c.text_model))
        vocab_size = int(encoder.hf.config.vocab_size)
        if mc.vocab_size != vocab_size:
            raise ConfigError(f"model.vocab_size is {mc.vocab_size} but the text encoder {c.text_model!r} has "
                              f"{vocab_size} WordPiece ids",
                              hint="MMCA needs data.tokenizer=wordpiece (the presets set it)")
        image = MMCAImageEncoder(mc.img_dim, mc.embed_size, c.heads, c.ffn_dim, c.dropout)
        text = MMCATextEncoder(encoder, mc.embed_size, c.filters, c.text_layernorm)
        head = MMCAHead(mc.embed_size, c.heads, c.ffn_dim, c.filters, c.dropout, c.alpha, c.text_layernorm,
                        c.three_term, c.train_negatives, c.pair_chunk)
        return Matcher(image, text, head)


@register_presets
def mmca_presets() -> dict[str, Preset]:
    """Section 4.2: hidden size 256 (best in Tables 4/5), Adam 2e-4 for 10 epochs then 2e-5 for 10, batch 64,
    margin 0.2, alpha 0.2 (Table 6); WordPiece tokens of the frozen text encoder."""
    base = {"train": {"epochs": 20, "lr": 2e-4, "lr_update": 10, "batch_size": 64},
            "loss": {"margin": 0.2}, "data": {"tokenizer": "wordpiece"}}
    variants = {"mmca": ("Tables 1-3: MMCA (d = 256, alpha = 0.2: the best of Tables 4-6)",
                         {"embed_size": 256, "mmca": {"alpha": 0.2}}),
                "mmca_alpha0": ("Table 6: alpha = 0 (self-attention module only)",
                                {"embed_size": 256, "mmca": {"alpha": 0.0}}),
                "mmca_h512": ("Tables 4/5: hidden size d = 512", {"embed_size": 512, "mmca": {"alpha": 0.2}})}
    return {name: {"model": {"arch": "mmca", **model}, **base, "paper": f"MMCA {row}"}
            for name, (row, model) in variants.items()}
