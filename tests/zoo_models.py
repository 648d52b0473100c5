"""Small models of many architectures, built and called as their users do (the model zoo).

``build(name)`` returns ``(model, args, kwargs)``: a freshly initialised model of two
layers (or stages) and hidden size 64, and one training batch with labels, passed with
the keyword options users pass. Dropout is off so that a compiled model and a single-device
one draw no random numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import autopar
from examples.handwritten import HANDWRITTEN

BATCH, SEQ, VOCAB, IMAGE = 4, 8, 128, 32

_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_NO_DROPOUT = dict(
    attention_dropout=0.0,
    hidden_dropout=0.0,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    dropout=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    dropout_rate=0.0,
    activation_dropout=0.0,
    drop_path_rate=0.0,
    classifier_dropout_prob=0.0,
    classifier_dropout=0.0,
    seq_classif_dropout=0.0,
    qa_dropout=0.0,
)


def _config(cls_name: str, **fields: Any) -> Any:
    import transformers

    config = getattr(transformers, cls_name)(**fields)
    for key, value in _NO_DROPOUT.items():
        if hasattr(config, key):
            setattr(config, key, value)
    return config


def _causal(model_cls: str, config_cls: str, **extra: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        import transformers

        model = getattr(transformers, model_cls)(_config(config_cls, **{**_DECODER, **extra}))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        return model, (), {"input_ids": ids, "labels": ids, "use_cache": False, "return_dict": True}

    return build


def _encoder(model_cls: str, config_cls: str, task: str, **extra: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        import transformers

        fields = dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        )
        model = getattr(transformers, model_cls)(_config(config_cls, **{**fields, **extra}))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        labels = ids if task == "mlm" else torch.randint(0, 2, (BATCH,))
        return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels, "return_dict": True}

    return build


def _vision(
    model_cls: str, config_cls: str, dtype: torch.dtype = torch.float32, **fields: Any
) -> Callable[[], tuple]:
    def build() -> tuple:
        import transformers

        model = getattr(transformers, model_cls)(_config(config_cls, num_labels=10, **fields)).to(dtype)
        images = torch.randn(BATCH, 3, IMAGE, IMAGE, dtype=dtype)
        return model, (), {"pixel_values": images, "labels": torch.randint(0, 10, (BATCH,))}

    return build


def _t5() -> tuple:
    import transformers

    config = _config(
        "T5Config",
        decoder_start_token_id=0,
        pad_token_id=0,
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
    )
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False, "return_dict": True}


def _bart() -> tuple:
    import transformers

    config = _config(
        "BartConfig",
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )
    model = transformers.BartForConditionalGeneration(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False, "return_dict": True}


def _gpt2() -> tuple:
    import transformers

    config = _config("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False, "return_dict": True}


def _phi3_gqa_fused() -> tuple:
    """Phi-3 with 8 heads and 2 kv heads: q, k and v in one projection of unequal parts (512, 128,
    128 features), given one sequence long enough that its attention splits by heads."""
    import transformers

    wide = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, max_position_embeddings=128)
    config = _config("Phi3Config", **{**_DECODER, **wide}, pad_token_id=0)
    model = transformers.Phi3ForCausalLM(config)
    ids = torch.randint(0, VOCAB, (1, 128))
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False, "return_dict": True}


def _phi3_gqa_annotated() -> tuple:
    """The GQA Phi-3 above with its q, k and v parts split over tp by a ``parameter_plan``."""
    model, args, kwargs = _phi3_gqa_fused()
    qkv = autopar.Parts("tp", (512, 128, 128))
    for layer in model.model.layers:
        autopar.shard(layer.self_attn, parameter_plan={"qkv_proj.weight": (qkv, None)})
    return model, args, kwargs


def _small_resnet() -> tuple:
    from examples import cnn

    model, args = cnn.build(batch_size=BATCH * 2)
    return model, args, {}


_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

ZOO: dict[str, Callable[[], tuple]] = {
    "gpt2": _gpt2,
    "llama": _causal("LlamaForCausalLM", "LlamaConfig"),
    "mistral": _causal("MistralForCausalLM", "MistralConfig"),
    "qwen2": _causal("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": _causal("Qwen3ForCausalLM", "Qwen3Config", head_dim=16),
    "phi3": _causal("Phi3ForCausalLM", "Phi3Config", pad_token_id=0),
    "phi3 (fused q, k, v of unequal parts)": _phi3_gqa_fused,
    "phi3 (unequal parts given over tp)": _phi3_gqa_annotated,
    "gemma2": _causal("Gemma2ForCausalLM", "Gemma2Config", head_dim=16),
    "olmo2": _causal("Olmo2ForCausalLM", "Olmo2Config"),
    "gpt-neox": _causal("GPTNeoXForCausalLM", "GPTNeoXConfig"),
    "opt": _causal("OPTForCausalLM", "OPTConfig", ffn_dim=128, word_embed_proj_dim=64),
    "falcon": _causal("FalconForCausalLM", "FalconConfig"),
    "bloom": _causal("BloomForCausalLM", "BloomConfig", n_head=4),
    "mixtral": _causal("MixtralForCausalLM", "MixtralConfig", **_MOE),
    "qwen3-moe": _causal(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
    "deepseek-v3": _causal(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        head_dim=8,  # the rotary part's
        num_key_value_heads=4,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "bert": _encoder("BertForMaskedLM", "BertConfig", "mlm"),
    "roberta": _encoder(
        "RobertaForSequenceClassification", "RobertaConfig", "cls", max_position_embeddings=72
    ),
    "distilbert": _encoder(
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        "cls",
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
    ),
    "t5": _t5,
    "bart": _bart,
    "vit": _vision(
        "ViTForImageClassification",
        "ViTConfig",
        image_size=IMAGE,
        patch_size=8,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    ),
    "swin": _vision(
        "SwinForImageClassification",
        "SwinConfig",
        image_size=IMAGE,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
    ),
    "convnext": _vision(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        image_size=IMAGE,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_stages=2,
    ),
    "resnet": _vision(
        "ResNetForImageClassification",
        "ResNetConfig",
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
    ),
    # seventeen batch norms over 4 images of noise: gradients reach ~1e3, where fp32's rounding
    # alone (batch norm's formula against torch's fused kernel, on one rank) exceeds atol=1e-5;
    # in float64 any real difference still shows, rounding does not
    "mobilenet-v2": _vision(
        "MobileNetV2ForImageClassification",
        "MobileNetV2Config",
        dtype=torch.float64,
        image_size=IMAGE,
        depth_multiplier=0.25,
    ),
    "small-resnet": _small_resnet,
    **HANDWRITTEN,
}


def build(name: str) -> tuple:
    """``(model, args, kwargs)`` of zoo model ``name``, initialised from the current seed."""
    import transformers

    transformers.logging.set_verbosity_error()
    return ZOO[name]()


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the model's first list of two or more modules of one class (its layers or
    stages), the modules a user recomputes."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and len(set(map(type, module))) == 1:
            return list(module)
    return []
