"""Models built on ``meta`` get the initial values their own code gives (autopar.runtime.initialize).

transformers models through the library's ``_init_weights`` (norms, rotary ``inv_freq``, BERT's
position ids, GPT-2's scaled projections, tied weights), torch's layers through
``reset_parameters()``, and a tensor nothing sets through a clear InitializationError.
Single process, except the last test, which compiles on torch's fake process group.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.ir.errors import AutoparError, InitializationError
from autopar.runtime.materialize import materialize

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _on_meta(build):
    with torch.device("meta"):
        return build()


def _llama_config(**overrides) -> transformers.LlamaConfig:
    base = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
    )
    return transformers.LlamaConfig(**{**base, **overrides})


def _assert_buffers_equal(model: nn.Module, reference: nn.Module) -> None:
    """Every buffer (persistent or not) equals the CPU-built reference's."""
    mine, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert mine.keys() == theirs.keys()
    for name, b in theirs.items():
        assert mine[name].device.type == "cpu", name
        torch.testing.assert_close(mine[name], b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"tie_word_embeddings": False},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}},
    ],
    ids=["tied", "untied", "linear-rope"],
)
def test_a_meta_built_llama_gets_transformers_own_initialisation(overrides):
    config = _llama_config(**overrides)
    meta = _on_meta(lambda: transformers.LlamaForCausalLM(config))
    on_cpu = transformers.LlamaForCausalLM(config)
    state = torch.random.get_rng_state()
    model = materialize(meta, seed=0)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG is left alone
    assert meta.model.norm.weight.is_meta  # the caller's model is untouched

    _assert_buffers_equal(model, on_cpu)  # rotary inv_freq and original_inv_freq, from the config
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:  # Linear and Embedding weights: N(0, initializer_range)
            assert p.std().item() == pytest.approx(config.initializer_range, rel=0.1), name
            assert abs(p.mean().item()) < 0.005, name
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == config.tie_word_embeddings

    again = materialize(meta, seed=0)
    other = materialize(meta, seed=1)
    for name, p in model.state_dict().items():
        assert torch.equal(p, again.state_dict()[name]), name  # what every rank computes
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(model.get_parameter(q), other.get_parameter(q))


def test_a_meta_built_gpt2_keeps_its_scaled_projections_and_tied_head():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    model = materialize(_on_meta(lambda: transformers.GPT2LMHeadModel(config)), seed=0)
    _assert_buffers_equal(model, transformers.GPT2LMHeadModel(config))
    assert model.lm_head.weight is model.transformer.wte.weight
    block = model.transformer.h[0]
    assert torch.equal(block.ln_1.weight, torch.ones(64)) and torch.equal(block.ln_1.bias, torch.zeros(64))
    assert block.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    scaled = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2's residual projections
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert torch.equal(block.attn.c_attn.bias, torch.zeros_like(block.attn.c_attn.bias))


def test_a_meta_built_bert_gets_its_position_and_token_type_buffers():
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = materialize(_on_meta(lambda: transformers.BertForMaskedLM(config)), seed=0)
    _assert_buffers_equal(model, transformers.BertForMaskedLM(config))  # position_ids, token_type_ids
    assert torch.equal(model.bert.embeddings.position_ids, torch.arange(64)[None])
    ln = model.bert.embeddings.LayerNorm
    assert torch.equal(ln.weight, torch.ones(64)) and torch.equal(ln.bias, torch.zeros(64))
    assert torch.equal(model.cls.predictions.bias, torch.zeros(128))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _plain() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.LayerNorm(16),
        nn.BatchNorm2d(3),
        nn.Embedding(10, 16, padding_idx=0),
        nn.MultiheadAttention(16, 2, batch_first=True),
    )


def test_a_plain_torch_model_gets_exactly_what_building_it_on_the_cpu_gives():
    """reset_parameters() children first is the order __init__ runs it: the same RNG stream."""
    model = materialize(_on_meta(_plain), seed=3)
    torch.manual_seed(3)
    on_cpu = _plain()
    for name, t in on_cpu.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    linear, norm, bn, emb, mha = model
    assert torch.equal(norm.weight, torch.ones(16)) and torch.equal(norm.bias, torch.zeros(16))
    assert torch.equal(bn.running_mean, torch.zeros(3)) and torch.equal(bn.running_var, torch.ones(3))
    assert bn.num_batches_tracked.item() == 0 and bn.num_batches_tracked.dtype == torch.long
    assert linear.weight.abs().max() <= 1 / math.sqrt(8)  # torch's kaiming-uniform bound
    assert torch.equal(emb.weight[0], torch.zeros(16))  # the padding row
    assert torch.equal(mha.in_proj_bias, torch.zeros(48))  # MultiheadAttention's _reset_parameters


def test_a_model_without_meta_tensors_is_returned_as_it_is():
    model = _plain()
    assert materialize(model, seed=0) is model


class Scaled(nn.Module):
    """A module with a parameter and a buffer that only its __init__ gives values."""

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4, device=device))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=device))


class Model(nn.Module):
    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([Scaled(device), Scaled(device)])


def test_a_tensor_nothing_initialises_is_named_with_what_to_do():
    with pytest.raises(InitializationError) as caught:
        materialize(_on_meta(Model), seed=0)
    message = str(caught.value)
    assert isinstance(caught.value, AutoparError)
    for name in ("layers.0.scale", "layers.0.steps", "layers.1.scale", "layers.1.steps"):
        assert f"  {name}: " in message
    assert "parameter of Scaled, shape (4,), torch.float32" in message
    assert "buffer of Scaled, shape (), torch.int64" in message
    assert "reset_parameters()" in message and "assign=True" in message and "init=fn" in message
    assert "embed.weight" not in message and "proj" not in message  # those torch initialises


def test_each_remedy_the_error_names_works():
    def check(model: nn.Module) -> None:
        for layer in model.layers:
            assert torch.equal(layer.scale, torch.ones(4)) and layer.steps.item() == 0
            assert torch.isfinite(layer.proj.weight).all()

    # tensors created off meta (or modules built on the CPU) keep their values
    meta = _on_meta(lambda: Model(device="cpu"))
    model = materialize(meta, seed=0)
    check(model)
    assert model.layers[0].scale is not meta.layers[0].scale  # a copy: the caller's model stays its own

    # values loaded before compiling (assign=True puts the real tensors in place)
    meta = _on_meta(Model)
    meta.load_state_dict(
        {f"layers.{i}.{k}": v for i in (0, 1) for k, v in Scaled("cpu").state_dict().items()},
        strict=False,
        assign=True,
    )
    check(materialize(meta, seed=0))

    # the caller's own init(module)
    def init(module: nn.Module) -> None:
        if isinstance(module, Scaled):
            nn.init.ones_(module.scale)
            module.steps.zero_()

    check(materialize(_on_meta(Model), seed=0, init=init))

    # a reset_parameters() on the module
    class WithReset(Scaled):
        def reset_parameters(self) -> None:
            nn.init.ones_(self.scale)
            self.steps.zero_()

    model = materialize(_on_meta(lambda: nn.ModuleDict({"a": WithReset(), "b": WithReset()})), seed=0)
    assert torch.equal(model.a.scale, torch.ones(4)) and model.b.steps.item() == 0


def test_a_failing_initializer_is_named():
    class Broken(nn.Linear):
        def reset_parameters(self) -> None:
            if not self.weight.is_meta:  # building on meta runs it too
                raise RuntimeError("boom")

    with pytest.raises(
        InitializationError, match=r"reset_parameters\(\) of 1 \(Broken\) failed: RuntimeError: boom"
    ):
        materialize(_on_meta(lambda: nn.Sequential(nn.Linear(2, 2), Broken(2, 2))), seed=0)


def test_compile_of_a_meta_built_llama_has_transformers_norm_weights(fake_process_group):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    config = _llama_config(tie_word_embeddings=True)
    model = _on_meta(lambda: transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 128, (4, 8))
    dmodel = autopar.compile(model, mesh, (ids,), example_kwargs={"labels": ids, "use_cache": False})
    norms = [(n, p) for n, p in dmodel.named_parameters() if "norm" in n]
    assert len(norms) == 2 * config.num_hidden_layers + 1
    for name, p in norms:
        assert torch.equal(p.full_tensor(), torch.ones(config.hidden_size)), name
    inv_freq = dict(dmodel.named_buffers())["model.rotary_emb.inv_freq"]
    expected = transformers.LlamaForCausalLM(config).model.rotary_emb.inv_freq
    assert torch.equal(inv_freq.full_tensor(), expected)
    q = dmodel.get_parameter("model.layers.0.self_attn.q_proj.weight").full_tensor()
    assert torch.isfinite(q).all() and q.std().item() == pytest.approx(config.initializer_range, rel=0.1)
