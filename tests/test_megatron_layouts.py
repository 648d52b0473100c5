"""Megatron's layouts: vocab-parallel embedding and cross entropy, fused projections split by heads.

Fast tests check the pieces: cross entropy's captured formula against torch for every
argument combination, partial maxima in the layout and step machinery. One world of 4
gloo ranks trains models next to one device (loss and every gradient equal): whose
vocabulary the plan splits (GPT-2 with tied embeddings, Llama with a padding index and a
vocabulary that does not divide, a head whose loss is split by sequence and an uneven
vocabulary at once), and whose fused projections are
split by heads (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj`` as strided
shards, GPT-NeoX's and Bloom's per-head interleaved ``query_key_value`` and Falcon's grouped
one plainly, Llama's queries with fewer kv heads than ranks), unchanged.
"""

from __future__ import annotations

import argparse
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.capture.class_losses import written_out
from autopar.ir.layout import format_layout, parse_layout
from autopar.ir.redistribution_steps import StepKind, axis_states, plan_steps, walk
from autopar.runtime.pieces import manual_whole
from autopar.tools import cli
from autopar.tools.launch import spawn
from tests.test_distributed import _assert_checkpoint_round_trip


@pytest.mark.parametrize("shape", [(6, 5), (5,), (3, 5, 4)], ids=str)
def test_cross_entropy_formula_is_torchs_for_every_argument(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    classes = shape[1] if len(shape) > 1 else shape[0]
    index = torch.randint(0, classes, (shape[0], *shape[2:]) if len(shape) > 1 else ())
    if index.dim():
        index.view(-1)[::3] = -100
    probs = torch.rand(shape, dtype=torch.float64).softmax(1 if len(shape) > 1 else 0)
    weight = torch.rand(classes, dtype=torch.float64)
    for target, w, smoothing, reduction in itertools.product(
        (index, probs), (None, weight), (0.0, 0.2), ("none", "sum", "mean")
    ):
        options = {"weight": w, "label_smoothing": smoothing, "reduction": reduction}
        want, got = F.cross_entropy(x, target, **options), written_out((x, target), options)
        torch.testing.assert_close(got, want)
        (want_grad,) = torch.autograd.grad(want.sum(), x)
        (got_grad,) = torch.autograd.grad(got.sum(), x)
        torch.testing.assert_close(got_grad, want_grad)


def test_half_precision_and_legacy_arguments_stay_fused():
    x, t = torch.randn(4, 5, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 3])
    assert written_out((x, t), {}) is None
    assert written_out((x.float(), t), {"size_average": False}) is None


def test_a_partial_maximum_prints_and_is_only_ever_reduced():
    layout = parse_layout("S(0)P(max)P")
    assert layout == (Shard(0), Partial("max"), Partial()) and format_layout(layout) == "S(0)P(max)P"
    src, dst = axis_states((Partial("max"), Replicate())), axis_states((Shard(1), Replicate()))
    steps = plan_steps(src, dst, lambda step: 0)
    assert steps == ((0, StepKind.ALL_REDUCE), (0, StepKind.SLICE))  # reduced, then sliced
    walked = walk(src, dst, dst, steps)
    assert walked[0].after == ("R", "R") and walked[1].after == (1, "R")
    with pytest.raises(ValueError, match="partial maximum"):
        plan_steps(axis_states((Replicate(),)), axis_states((Partial("max"),)), lambda step: 0)


class _Head(nn.Module):
    """An LM head and its loss, with label smoothing and ignored targets."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, vocab, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.proj(hidden)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=0.1)


def _gpt2() -> tuple:
    import transformers

    config = transformers.GPT2Config(vocab_size=1000, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, key, 0.0)
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to wte
    autopar.shard(model.lm_head, parameter_plan={"weight": ("tp", None)})
    ids = torch.randint(0, 1000, (2, 16))
    labels = ids.clone()
    labels[:, :3] = -100
    return model, (), {"input_ids": ids, "labels": labels, "use_cache": False}


def _llama() -> tuple:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1001,  # over tp=2: pieces of 501 and 500 rows
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=3,
    )
    model = transformers.LlamaForCausalLM(config)
    autopar.shard(model.model.embed_tokens, parameter_plan={"weight": ("tp", None)})
    autopar.shard(model.lm_head, parameter_plan={"weight": ("tp", None)})
    ids = torch.randint(0, 1001, (4, 16))
    ids[0, :5] = 3  # padding: the padded row gets no gradient
    labels = torch.where(ids == 3, -100, ids)
    return model, (), {"input_ids": ids, "labels": labels, "use_cache": False}


def _head_split_by_sequence_and_vocabulary() -> tuple:
    model = _Head(32, 97)  # 97 classes over tp=2: pieces of 49 and 48
    autopar.shard(
        model, in_strategy=((None, "dp", None), (None, "dp")), parameter_plan={"proj.weight": ("tp", None)}
    )
    labels = torch.randint(0, 97, (2, 8))
    labels[:, ::3] = -100
    return model, (torch.randn(2, 8, 32), labels), {}


def _tiny(config_cls: str, model_cls: str, **fields: object) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        **fields,
    )
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return getattr(transformers, model_cls)(config)


def _batch() -> dict:
    ids = torch.randint(0, 96, (2, 8))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _gpt2_by_heads() -> tuple:
    import transformers

    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, key, 0.0)
    model = transformers.GPT2LMHeadModel(config)
    qkv = autopar.Parts("tp", 3)
    for block in model.transformer.h:  # Conv1D weights are (in, out): q, k and v side by side
        autopar.shard(block.attn, parameter_plan={"c_attn.weight": (None, qkv), "c_attn.bias": (qkv,)})
    return model, (), _batch()


def _phi3_by_heads() -> tuple:
    model = _tiny("Phi3Config", "Phi3ForCausalLM", num_key_value_heads=4, pad_token_id=0)
    for layer in model.model.layers:
        autopar.shard(layer.self_attn, parameter_plan={"qkv_proj.weight": (autopar.Parts("tp", 3), None)})
        autopar.shard(layer.mlp, parameter_plan={"gate_up_proj.weight": (autopar.Parts("tp", 2), None)})
    return model, (), _batch()


def _neox_by_heads() -> tuple:
    model = _tiny("GPTNeoXConfig", "GPTNeoXForCausalLM")
    for layer in model.gpt_neox.layers:  # q, k and v interleaved per head: a plain split
        autopar.shard(layer.attention, parameter_plan={"query_key_value.weight": ("tp", None)})
    return model, (), _batch()


def _llama_gqa_by_heads() -> tuple:
    model = _tiny("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)  # 2 kv heads, tp=4
    for layer in model.model.layers:  # k and v left to the solver: fewer heads than ranks
        autopar.shard(
            layer.self_attn, parameter_plan={"q_proj.weight": ("tp", None), "o_proj.weight": (None, "tp")}
        )
    return model, (), _batch()


def _bloom_and_falcon_by_heads() -> tuple:
    """Bloom's q, k, v interleaved per head; Falcon's grouped per kv head: plain splits."""
    import transformers

    bloom = transformers.BloomConfig(vocab_size=96, hidden_size=64, n_layer=1, n_head=4)
    falcon = transformers.FalconConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
    )
    models = [transformers.BloomForCausalLM(bloom), transformers.FalconForCausalLM(falcon)]
    for model in models:
        for block in model.transformer.h:
            attention = block.self_attention
            autopar.shard(attention, parameter_plan={"query_key_value.weight": ("tp", None)})
    return _Both(*models), (), _batch()


class _Both(nn.Module):
    """Two causal LMs trained on one batch: the sum of their losses."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, **batch: object) -> torch.Tensor:
        return self.first(**batch).loss + self.second(**batch).loss


class _Clicks(nn.Module):
    """examples/recommender.py's model with its loss: a table split by ``ManualSplit``."""

    def __init__(self) -> None:
        from examples.recommender import Recommender, annotate

        super().__init__()
        self.model = Recommender()
        annotate(self.model)

    def forward(self, user, history, item, clicks) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self.model(user, history, item), clicks)


def _recommender_by_chosen_rows() -> tuple:
    from examples.recommender import build

    _, inputs, clicks = build()
    return _Clicks(), (*inputs, clicks), {}


CASES = {
    "gpt2-by-heads": ((4,), _gpt2_by_heads),
    "bloom-falcon-by-heads": ((2, 2), _bloom_and_falcon_by_heads),
    "llama-gqa-by-heads": ((4,), _llama_gqa_by_heads),
    "phi3-by-heads": ((2, 2), _phi3_by_heads),
    "neox-by-heads": ((4,), _neox_by_heads),
    "gpt2": ((4,), _gpt2),
    "llama": ((2, 2), _llama),
    "head": ((2, 2), _head_split_by_sequence_and_vocabulary),
    "manual": ((2, 2), _recommender_by_chosen_rows),
}


def _run(name: str, checkpoint_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.tools.numerics import first_divergence

    shape, build = CASES[name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[-len(shape) :])
    torch.manual_seed(0)
    model, args, kwargs = build()
    reference = copy.deepcopy(model)
    dmodel = autopar.compile(model, mesh, args, example_kwargs=kwargs, cluster="fast-links", time_limit=10)
    # every value of the forward (masked lookups, partial maxima, strided and uneven pieces)
    assert first_divergence(dmodel, reference, *args, **kwargs) is None
    local_args, local_kwargs = dmodel.shard_inputs(*args, **kwargs)
    out, want = dmodel(*local_args, **local_kwargs), reference(*args, **kwargs)
    loss, ref_loss = (out, want) if isinstance(out, torch.Tensor) else (out.loss, want.loss)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-4)
    if name in ("llama", "gpt2-by-heads"):  # logits split by (an uneven) vocabulary, gathered whole
        logits = dmodel.gather_outputs(out).logits
        torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-4)
    if name in ("llama", "gpt2-by-heads", "manual"):
        # strided, uneven and chosen-rows parameters survive a DCP round trip into a module of the same plan
        torch.manual_seed(1)
        fresh = autopar.compile(CASES[name][1]()[0], mesh, args, example_kwargs=kwargs, plan=dmodel.plan)
        _assert_checkpoint_round_trip(dmodel, fresh, reference, f"{checkpoint_dir}/{name}")
    loss.backward()
    ref_loss.backward()
    for pname, p in dmodel.named_parameters():
        grad = p.grad.full_tensor()
        if pname in dmodel.plan.manual_rows:  # held padded: the rows of each rank laid end to end
            grad = manual_whole(grad, *dmodel.plan.manual_rows[pname])
        torch.testing.assert_close(grad, reference.get_parameter(pname).grad, atol=1e-5, rtol=1e-4, msg=pname)
    plan = dmodel.plan
    gathered = [n for n in plan.nodes if n.op == "aten.gather.default"]
    return {
        "gather": [n.operands[0] for n in gathered],
        "embedding": [n.operands[0] for n in plan.nodes if n.op == "aten.embedding.default"],
        "parameters": dict(plan.parameters),
        "local": {name: tuple(p.to_local().shape) for name, p in dmodel.named_parameters()},
    }


def _world(names: list[str], checkpoint_dir: str) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    for name in names:
        try:
            results[name] = _run(name, checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - reported by the test, with the case's name
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    return results


@pytest.mark.distributed
def test_vocab_parallel_models_train_on_4_gloo_ranks_as_on_one_device(tmp_path):
    results = spawn(_world, 4, list(CASES), str(tmp_path))[0]
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not errors, errors
    # the loss picks its target's logit from logits split by vocabulary: never gathered whole
    by_heads = {name: results.pop(name) for name in list(results) if name.endswith("by-heads")}
    gpt2 = by_heads["gpt2-by-heads"]
    assert gpt2["parameters"]["transformer.h.0.attn.c_attn.weight"] == "S(1)x3"
    assert gpt2["local"]["transformer.h.0.attn.c_attn.weight"] == (64, 48)  # a head of each of q, k, v
    phi3 = by_heads["phi3-by-heads"]["parameters"]
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"].endswith("S(0)x3")
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"].endswith("S(0)x2")
    assert (
        by_heads["neox-by-heads"]["parameters"]["gpt_neox.layers.0.attention.query_key_value.weight"]
        == "S(0)"
    )
    manual = results.pop("manual")
    assert manual["parameters"]["model.users.weight"] == "RS(0)"
    assert manual["local"]["model.users.weight"] == (700, 16)  # rank 0's 700 rows (rank 1's 300, padded)
    for name, result in results.items():
        (gather,) = result["gather"]
        assert parse_layout(gather)[-1] == Shard(1), (name, gather)  # over tp: the classes
    assert parse_layout(results["llama"]["embedding"][0])[-1] == Shard(0)  # the vocabulary
    assert results["llama"]["local"]["lm_head.weight"] == (501, 64)  # rank 0's piece of 1001 rows
    assert parse_layout(results["head"]["gather"][0])[0] == Shard(0)  # over dp: the tokens


def test_the_plan_names_vocab_parallel_strided_and_uneven_layouts(tmp_path, capsys):
    """Summary, saved plan (explain) and viz data say which layouts are Megatron's, by name."""
    from autopar.tools.plan_view import plan_graph
    from examples.megatron_gpt2 import annotate, build

    torch.manual_seed(0)
    model, batch = build()
    annotate(model)
    plan = autopar.plan(model, (), {"dp": 2, "tp": 2}, example_kwargs=batch, cluster="fast-links")
    lines = list(plan.named_layouts.values())
    assert any(
        line.startswith("vocab-parallel embedding in 'transformer.wte': lm_head.weight") for line in lines
    )
    assert any(line.startswith("vocab-parallel gather") for line in lines)  # the loss's target logit
    assert "strided transformer.h.0.attn.c_attn.weight: dim 1 (192) holds 3 equal parts" in plan.summary(
        width=200
    )
    plan.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json").named_layouts == plan.named_layouts
    lookup = next(
        name for name, line in plan.named_layouts.items() if line.startswith("vocab-parallel gather")
    )
    cli.cmd_explain(argparse.Namespace(plan=str(tmp_path / "plan.json"), node=lookup))
    assert f"  layout: {plan.named_layouts[lookup]}" in capsys.readouterr().out
    assert {n["named"] for n in plan_graph(plan)["nodes"]} >= {"vocab-parallel", "strided"}

    head = _Head(32, 97)
    autopar.shard(head, parameter_plan={"proj.weight": ("tp", None)})
    plan = autopar.plan(head, (torch.randn(2, 8, 32), torch.randint(0, 97, (2, 8))), {"tp": 4})
    assert (
        plan.named_layouts["p_proj_weight"]
        == "uneven proj.weight: dim 0 (97) over tp in pieces of 25, 25, 25, 22"
    )
