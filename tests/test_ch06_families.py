"""Model families (code/ch06_capstone/families.py): each tiny config builds and trains, the
buffers to_empty leaves empty come back, a model folder loads, bad ones are one line; and on 2
ranks every family trained with FSDP2 on masked labels equals one process
(ch06_capstone/family_parity.py, one launch)."""
import math
import sys

import pytest
import torch

from conftest import CODE, run_in_process, run_json

sys.path.insert(0, str(CODE / "ch06_capstone"))
import families  # noqa: E402
from distkit.tokens import IGNORE, global_token_loss  # noqa: E402

TIED = {"qwen2", "gemma2", "gemma3_text"}


@pytest.mark.second_nproc  # make test's family_parity launch trains every family already
def test_each_family_builds_and_trains_on_cpu():
    """Every tiny config: the parts the recipe shards, a forward + backward with real
    cross-entropy on shifted, partly masked labels (about ln(vocab) at the start, finite), a
    gradient on every parameter; the MoE families' experts and router where expert parallelism
    will need them."""
    from transformers import AutoModelForCausalLM
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels = x[:, :-1], x[:, 1:].clone()
    labels[:, :5] = IGNORE  # a prompt
    for family in families.FAMILIES:
        config = families.tiny_config(family, vocab_size=96, seq_len=32)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        p = families.parts(model)
        assert (p.family, len(p.layers), p.tied) == (family, 2, family in TIED)
        assert p.embed.weight.shape == (96, 32) and p.lm_head.weight.shape == (96, 32)
        assert families.fsdp_units(model) == [*p.layers, model]
        assert families.fsdp_units(model, embedding_unit=True)[-2:] == (
            [p.layers[-1], model] if p.tied else [p.embed, model])
        loss = global_token_loss(model(input_ids=inputs).logits, labels)
        loss.backward()
        assert abs(loss.item() - math.log(96)) < 0.5, (family, loss.item())
        assert all(q.grad is not None and q.grad.isfinite().all() for q in model.parameters())
        if family in families.MOE:
            assert len(p.moe) == 2 and (p.moe[0].num_experts, p.moe[0].top_k) == (4, 2)
            experts, router = p.moe[0].experts, p.moe[0].router
            inter = config.moe_intermediate_size if family == "qwen3_moe" \
                else config.intermediate_size
            assert experts.gate_up_proj.shape == (4, 2 * inter, 32)
            assert experts.down_proj.shape == (4, 32, inter)
            assert router.weight.shape == (4, 32) and router.weight.grad.abs().sum() > 0
            assert "active per token" in families.describe(model)
            out = model(input_ids=inputs, output_router_logits=True)
            load = families.tokens_per_expert(out.router_logits, top_k=2)
            assert load.shape == (2, 4) and load.sum(1).tolist() == [inputs.numel() * 2] * 2
            term = families.aux_loss_term(out, config, pieces=4)
            assert abs(term.item() - config.router_aux_loss_coef * out.aux_loss.item() / 4) < 1e-9
            assert 1.9 < out.aux_loss.item() < 4  # E sum f_e P_e: even routing gives top_k
        else:
            assert p.moe == [] and families.aux_loss_term(model(input_ids=inputs), config, 2) == 0


def test_restore_buffers_after_to_empty():
    """Meta init (the recipe's path): to_empty leaves Gemma 3's embed_scale and its per-layer-type
    rotary inv_freq as garbage (NaN here); the state dict does not hold them; restore_buffers
    refills them and the logits equal the full model's. Without it: NaN (the wrong answer)."""
    from transformers import AutoModelForCausalLM
    config = families.tiny_config("gemma3_text")
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(config)
    skeleton, state = families.skeleton(config), full.state_dict()
    x = torch.randint(0, 96, (1, 12))
    expected = full(input_ids=x).logits
    skeleton.to_empty(device="cpu")
    skeleton.load_state_dict(state)
    names = {n for m in skeleton.modules() for n in m._non_persistent_buffers_set}
    assert {"embed_scale", "sliding_attention_inv_freq", "full_attention_inv_freq"} <= names
    for m in skeleton.modules():
        for n in m._non_persistent_buffers_set:
            getattr(m, n).fill_(float("nan"))
    assert skeleton(input_ids=x).logits.isnan().all()
    families.restore_buffers(skeleton, config)
    assert (skeleton(input_ids=x).logits - expected).abs().max() < 1e-6


def test_a_model_folder_loads_and_bad_ones_are_one_line(tmp_path):
    """A saved folder (config.json + safetensors) of a tied family: load_config and build give
    its weights; no config.json, an encoder-decoder and a model type with no causal LM are
    refused with one line naming the file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(families.tiny_config("qwen2"))
    saved.save_pretrained(tmp_path / "qwen2")
    config = families.load_config(str(tmp_path / "qwen2"))
    assert config.model_type == "qwen2" and config.use_cache is False
    _, state = families.build(config, model_path=str(tmp_path / "qwen2"))
    assert all(torch.equal(state[k], v) for k, v in saved.state_dict().items())
    assert (state["lm_head.weight"].data_ptr()  # tied: one tensor
            == state["model.embed_tokens.weight"].data_ptr())
    assert families.parts(families.skeleton(config)).tied
    with pytest.raises(families.UnsupportedModel, match=r"no config\.json"):
        families.load_config(str(tmp_path))
    for model_type, reason in (("t5", "is an encoder-decoder model"),
                               ("vit", "transformers has no causal LM for this model type")):
        AutoConfig.for_model(model_type).save_pretrained(tmp_path / model_type)
        with pytest.raises(families.UnsupportedModel) as e:
            families.load_config(str(tmp_path / model_type))
        assert str(e.value).startswith(str(tmp_path / model_type / "config.json"))
        assert reason in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(families.UnsupportedModel, match="unknown family 'gpt5'"):
        families.tiny_config("gpt5")


def test_tiny_configs_take_a_preset_shape():
    """Any family at train_llama.py's cpu-tiny width: head_dim = hidden / heads everywhere
    (Qwen3 defaults to 128, Gemma to 256), the preset's tying kept."""
    preset = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    for family in families.FAMILIES:
        config = families.tiny_config(family, vocab_size=2048, seq_len=128, **preset)
        assert (config.head_dim, config.num_hidden_layers, config.tie_word_embeddings) == (
            32, 4, True), family
        model = families.skeleton(config)
        q = families.parts(model).layers[0].self_attn.q_proj
        assert q.weight.shape == (128, 128), family


def check(results, normalisations):
    for family, res in results["families"].items():
        assert res["global"]["parity"], (family, res["global"])
        assert res["global"]["still_tied"] == res["tied"] == (family in TIED)
        assert res["global"]["max_grad_diff"] < 1e-6
        assert res["global"]["resumed_bit_identical"], family
        valid = res["global"]["valid_tokens_per_rank_and_micro_batch"]
        assert len({v for rank in valid for v in rank}) == 4  # unequal everywhere
    for normalisation in normalisations:
        wrong = results["families"]["qwen2"][normalisation]
        assert not wrong["parity"] and wrong["max_grad_diff"] > 1e-3
        if normalisation == "no-factor":  # the loss hides it, the gradients do not
            assert wrong["max_loss_diff"] < 1e-5 and abs(wrong["grad_scale"] - 0.5) < 1e-3
    assert results["ok"]


def test_every_family_equals_one_process_on_two_ranks(tmp_path):
    """One launch, every family: FSDP2 on 2 ranks, masked labels with unequal valid tokens per
    rank and micro-batch = one process (losses of 2 steps, every step-1 gradient); tied
    embeddings stay tied; resumed from step 1's checkpoint, step 2 is bit-identical; on Qwen2
    (tied) the mean of means and the missing divide factor fail.
    (All eight families cost ~2.5 CPU-s more than Qwen2 alone: the launch's imports dominate.)"""
    results, out = run_json(tmp_path, 2, "ch06_capstone/family_parity.py")
    assert set(results["families"]) == set(families.FAMILIES)
    check(results, ["mean", "no-factor"])
    assert "every family equals one process, every wrong answer fails: True" in out


@pytest.mark.parametrize("args, message", [
    (["--families", "llama,gpt5"], "--families: unknown gpt5"),
    (["--wrong", "half"], "--wrong: unknown half"),
    (["--families", "llama"], "--wrong-on qwen2 is not in --families"),
    (["--batch-size", "6"], "--batch-size must be a multiple of 2 x 2 ranks"),
])
def test_family_parity_bad_input(monkeypatch, capsys, args, message):
    code, _, err = run_in_process(monkeypatch, capsys, "ch06_capstone/family_parity.py", *args,
                                  env={"WORLD_SIZE": "2"})
    assert code == 2 and message in err.splitlines()[-1]
