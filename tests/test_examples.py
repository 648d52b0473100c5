"""The example models: losses and shapes, module names, meta builds, torch.export capture, the scripts."""

from __future__ import annotations

import importlib
import re
import runpy
from types import ModuleType

import pytest
import torch
from torch import nn

EXAMPLES = ["examples.mlp", "examples.gpt"]


@pytest.fixture(params=EXAMPLES)
def example(request: pytest.FixtureRequest) -> ModuleType:
    return importlib.import_module(request.param)


@pytest.fixture
def gpt() -> ModuleType:
    return importlib.import_module("examples.gpt")


@pytest.fixture
def mlp() -> ModuleType:
    return importlib.import_module("examples.mlp")


def test_loss_is_a_finite_scalar_with_gradients_for_every_parameter(example: ModuleType):
    torch.manual_seed(0)
    model, args = example.build()
    loss = model(*args)
    assert loss.shape == ()
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_meta_build_allocates_nothing(example: ModuleType):
    model, args = example.build(device="meta")
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers(), *args))


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("examples.mlp", {}), ("examples.gpt", {}), ("examples.gpt", {"tied_embeddings": True})],
    ids=["mlp", "gpt", "gpt-tied"],
)
def test_export_on_meta_captures_the_loss(name: str, overrides: dict[str, bool]):
    model, args = importlib.import_module(name).build(device="meta", **overrides)
    ep = torch.export.export(model, args, strict=False)
    (loss,) = ep.graph.output_node().args[0]
    assert loss.meta["val"].shape == ()
    # Export lists a tied weight under each of its names; plans refer to parameters by these names.
    assert set(ep.graph_signature.parameters) == set(dict(model.named_parameters(remove_duplicate=False)))


@pytest.mark.smoke
def test_script_prints_the_parameter_count(
    example: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    model, _ = example.build(getattr(example, "DEMO", example.TINY))
    n_params = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr("sys.argv", [example.__file__])
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(example.__file__, run_name="__main__")
    out = capsys.readouterr().out
    assert f"{n_params:,} parameters" in out
    if example.__name__.endswith("gpt"):
        assert "autopar plan on mesh dp=2×tp=2" in out and "blocks.0.mlp.fc" in out


@pytest.mark.smoke
def test_gpt_script_searches_the_mesh_for_a_device_count(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """``--mesh 4`` gives the planner a device count: it prints the meshes it searched, priced
    with the cluster ``--cluster`` names."""
    script = importlib.import_module("examples.gpt")
    monkeypatch.setattr("sys.argv", [script.__file__, "--tiny", "--mesh", "4", "--cluster", "fast-links"])
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(script.__file__, run_name="__main__")
    out = capsys.readouterr().out
    assert "(fast-links)" in out and "meshes searched (the device count given)" in out
    assert "dp=2×tp=2" in out and "dp=4" in out and "chosen" in out


def test_mlp_widths_and_output(mlp: ModuleType):
    model, (x, target) = mlp.build(d_in=5, d_hidden=7, d_out=3, n_layers=4, batch_size=2)
    widths = [(layer.in_features, layer.out_features) for layer in model.layers]
    assert widths == [(5, 7), (7, 7), (7, 7), (7, 3)]
    assert model(x).shape == target.shape == (2, 3)
    assert torch.equal(model(x, target), nn.functional.mse_loss(model(x), target))


def test_mlp_single_layer_maps_input_to_output(mlp: ModuleType):
    model = mlp.MLP(d_in=5, d_hidden=7, d_out=3, n_layers=1)
    assert [(layer.in_features, layer.out_features) for layer in model.layers] == [(5, 3)]
    with pytest.raises(ValueError, match="n_layers"):
        mlp.MLP(d_in=5, d_hidden=7, d_out=3, n_layers=0)


def test_gpt_module_names(gpt: ModuleType):
    model, _ = gpt.build(n_layers=3, device="meta")
    cfg = model.config
    assert len(model.blocks) == 3
    for name in ("q", "k", "v"):
        proj = model.get_submodule(f"blocks.2.attn.{name}")
        assert (proj.in_features, proj.out_features) == (cfg.d_model, cfg.d_model)
    fc = model.get_submodule("blocks.0.mlp.fc")
    assert (fc.in_features, fc.out_features) == (cfg.d_model, cfg.d_ff)
    for name in [
        "wte",
        "wpe",
        "blocks.0.ln_1",
        "blocks.0.attn.proj",
        "blocks.0.ln_2",
        "blocks.0.mlp.proj",
        "ln_f",
    ]:
        model.get_submodule(name)
    assert model.lm_head.bias is None


def test_gpt_logits_are_causal(gpt: ModuleType):
    torch.manual_seed(0)
    model, (idx, _) = gpt.build()
    logits = model(idx)
    assert logits.shape == (*idx.shape, model.config.vocab_size)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab_size
    # Changing the last token may change only the last position's logits.
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])


def test_gpt_tied_embeddings_share_one_weight(gpt: ModuleType):
    model, _ = gpt.build(tied_embeddings=True, device="meta")
    assert model.lm_head.weight is model.wte.weight


def test_gpt2_small_preset_has_gpt2_parameter_count(gpt: ModuleType):
    model, (idx, targets) = gpt.build(gpt.GPT2_SMALL, batch_size=8, device="meta")
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    assert idx.shape == targets.shape == (8, 1024)


def test_gpt_rejects_bad_sizes(gpt: ModuleType):
    with pytest.raises(ValueError, match="divisible"):
        gpt.build(n_heads=5)
    model, _ = gpt.build()
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, model.config.seq_len + 1, dtype=torch.long))


@pytest.mark.smoke
def test_cnn_script_plans_without_ranks(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """Without torchrun, examples/cnn.py prints its size and its plan for 4 ranks."""
    cnn = importlib.import_module("examples.cnn")
    monkeypatch.setattr("sys.argv", [cnn.__file__])
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(cnn.__file__, run_name="__main__")
    out = capsys.readouterr().out
    assert "SmallResNet: 14,202 parameters" in out and "autopar plan on mesh dp=4" in out
    assert "no sharding rule" not in out


@pytest.mark.smoke
def test_megatron_gpt2_script_plans_heads_and_vocabulary(capsys: pytest.CaptureFixture[str], monkeypatch):
    """Without torchrun, examples/megatron_gpt2.py prints its plan: c_attn by heads, loss by vocabulary."""
    script = importlib.import_module("examples.megatron_gpt2")
    monkeypatch.setattr("sys.argv", [script.__file__])
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(script.__file__, run_name="__main__")
    out = capsys.readouterr().out
    assert "autopar plan on mesh dp=2×tp=2" in out and "no sharding rule" not in out
    assert "transformer.h.0.attn.c_attn.weight │ RS(1)x3" in out
    # the loss's row maximum, all-reduced over the axis that splits the vocabulary (the solver's)
    assert re.search(r"│ \S*P\(max\)\S*->\S* *│ all_reduce", out)


@pytest.mark.smoke
def test_recommender_script_plans_the_user_table_in_chosen_rows(
    capsys: pytest.CaptureFixture[str], monkeypatch
):
    """Without torchrun, examples/recommender.py prints its plan: the user table in 700 and 300 rows."""
    script = importlib.import_module("examples.recommender")
    monkeypatch.setattr("sys.argv", [script.__file__])
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(script.__file__, run_name="__main__")
    out = capsys.readouterr().out
    assert "no sharding rule" not in out
    assert "manual users.weight: dim 0 (1000) over tp in rows of 700, 300 (ManualSplit)" in out


@pytest.mark.smoke
def test_handwritten_script_plans_the_reference_llama_by_heads(
    capsys: pytest.CaptureFixture[str], monkeypatch
):
    """Without torchrun, examples/handwritten.py prints its plan: q, k, v by heads, rotary pairs with them."""
    script = importlib.import_module("examples.handwritten")
    monkeypatch.setattr("sys.argv", [script.__file__])
    monkeypatch.delenv("RANK", raising=False)
    runpy.run_path(script.__file__, run_name="__main__")
    out = capsys.readouterr().out
    assert "autopar plan on mesh dp=2×tp=2" in out and "no sharding rule" not in out
    assert re.search(r"│ model\.layers\.0\.attention\.wq\.weight +│ RS\(0\) ", out)
    assert re.search(r"│ view_as_real +│ S\(0\)S\(2\) ", out)  # the rotary pairs split with the heads
