"""The Llama family: the model's shapes and causality, presets, configs of both families, pipeline stages and CheckFree."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.checkfree import rebuild_stage, restore_from_replica
from swarm.models.llama import Llama, LlamaConfig, hf_names, rope_cos_sin
from swarm.models.presets import (GPT, PRESETS, GPTConfig, build_model, config_from_dict, config_from_hf, model_flops_per_token,
                         num_params, preset, with_vocab)
from swarm.stages import Stage

TINY = preset("llama-tiny")
UNTIED = dataclasses.replace(TINY, tie_embeddings=False, n_layer=3, vocab_size=300)


def test_forward_shapes_loss_and_context_limit():
    torch.manual_seed(0)
    model = build_model(TINY)
    assert isinstance(model, Llama) and not hasattr(model, "pos_emb")
    x, y = torch.randint(0, TINY.vocab_size, (2, 2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, TINY.vocab_size) and loss.dtype == torch.float32
    assert abs(loss.item() - torch.log(torch.tensor(float(TINY.vocab_size))).item()) < 0.5  # near uniform at init
    assert model(x)[1] is None
    with pytest.raises(ValueError, match="exceeds the model context"):
        model(torch.zeros(1, TINY.context + 1, dtype=torch.long))


def test_causal_a_future_token_does_not_change_earlier_logits():
    torch.manual_seed(1)
    model = build_model(TINY).eval()
    x = torch.randint(0, TINY.vocab_size, (1, 24))
    y = x.clone()
    y[0, 15] = (y[0, 15] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(x)[0], model(y)[0]
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_grouped_query_attention_shapes_and_equivalence_to_repeated_heads():
    cfg = dataclasses.replace(TINY, n_head=8, n_kv_head=2, d_model=64)
    block = build_model(cfg).blocks[0]
    attn = block.self_attn
    assert attn.q_proj.weight.shape == (64, 64) and attn.k_proj.weight.shape == (16, 64) == attn.v_proj.weight.shape
    # the same block as plain multi-head attention, k/v heads repeated by hand, gives the same output
    mha_cfg = dataclasses.replace(cfg, n_kv_head=8)
    mha = build_model(mha_cfg).blocks[0]
    hd, groups = cfg.head_dim, cfg.n_head // cfg.n_kv_head
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = dict(block.named_parameters())[name]
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                p.copy_(src.view(cfg.n_kv_head, hd, -1).repeat_interleave(groups, dim=0).reshape_as(p))
            else:
                p.copy_(src)
        x = torch.randn(2, 10, 64)
        torch.testing.assert_close(block(x), mha(x))
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        dataclasses.replace(TINY, n_kv_head=3)


def test_rope_follows_the_hugging_face_convention():
    cos, sin = rope_cos_sin(5, 8, 10000.0, torch.device("cpu"), torch.float32)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    torch.testing.assert_close(cos[3, :4], torch.cos(3 * inv))
    torch.testing.assert_close(cos[:, :4], cos[:, 4:])  # halves repeated, not interleaved
    torch.testing.assert_close(sin[0], torch.zeros(8))


def test_tied_and_untied_parameter_counts():
    d, V = TINY.d_model, TINY.vocab_size
    tied, untied = build_model(TINY), build_model(dataclasses.replace(TINY, tie_embeddings=False))
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == V * d
    block = d * d + 2 * d * (TINY.n_kv_head * TINY.head_dim) + d * d + 3 * d * TINY.d_ff + 2 * d
    assert tied.num_params() == V * d + TINY.n_layer * block + d == num_params(TINY)
    assert not any(n.endswith("bias") for n, _ in untied.named_parameters())


@pytest.mark.parametrize("name, low, high", [("llama-tiny", 0.5e6, 2e6), ("llama-20m", 18e6, 23e6),
                                             ("llama-150m", 135e6, 165e6), ("llama-1b", 1.1e9, 1.2e9)])
def test_preset_sizes(name, low, high):
    cfg = preset(name)
    assert isinstance(cfg, LlamaConfig) and low <= num_params(cfg) <= high
    assert model_flops_per_token(cfg) > 6 * num_params(cfg) * 0.9


def _built_count(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_counted_parameters_of_every_preset_are_those_of_the_built_model(name):
    assert num_params(preset(name)) == _built_count(preset(name))


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2]), width=st.sampled_from([8, 16, 24]),
       vocab=st.integers(1, 300), ff=st.integers(1, 64), tied=st.booleans(), context=st.integers(1, 64))
def test_the_counted_parameters_follow_any_config(layers, heads, kv, width, vocab, ff, tied, context):
    d = width * heads
    gpt = GPTConfig(vocab_size=vocab, context=context, n_layer=layers, n_head=heads, d_model=d)
    assert num_params(gpt) == _built_count(gpt)
    if heads % kv == 0 and (d // heads) % 2 == 0:
        llama = LlamaConfig(vocab_size=vocab, context=context, n_layer=layers, n_head=heads, n_kv_head=kv, d_model=d, d_ff=ff,
                            tie_embeddings=tied)
        assert num_params(llama) == _built_count(llama)


def test_flops_per_token_formula():
    gpt = preset("tiny")
    n = GPT(gpt).num_params() - gpt.context * gpt.d_model
    assert model_flops_per_token(gpt) == 6 * n + 12 * gpt.n_layer * gpt.d_model * gpt.context
    untied = dataclasses.replace(TINY, tie_embeddings=False)
    n = num_params(untied) - TINY.vocab_size * TINY.d_model
    assert model_flops_per_token(untied) == 6 * n + 12 * TINY.n_layer * TINY.d_model * TINY.context


def test_config_dicts_round_trip_for_both_families_and_old_gpt_dicts():
    for cfg in PRESETS.values():
        d = json.loads(json.dumps(cfg.to_dict()))
        assert config_from_dict(d) == cfg
    assert TINY.to_dict()["family"] == "llama" and "family" not in preset("tiny").to_dict()  # old GPT dicts unchanged
    old = {"vocab_size": 256, "context": 128, "n_layer": 4, "n_head": 4, "d_model": 128, "dropout": 0.0}
    assert config_from_dict(old) == preset("tiny") and config_from_dict({**old, "family": "gpt"}) == preset("tiny")
    assert config_from_dict({**TINY.to_dict(), "rope_theta": 10000}).rope_theta == 10000.0
    with pytest.raises(ValueError, match="unknown model family"):
        config_from_dict({"family": "mamba"})
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        config_from_dict({**TINY.to_dict(), "dropout": 0.1})
    with pytest.raises(ValueError, match="n_layer must be int"):
        config_from_dict({**TINY.to_dict(), "n_layer": "4"})
    assert with_vocab(TINY, 1000).vocab_size == 1000 and with_vocab(TINY, 1000).d_model == TINY.d_model
    assert build_model(with_vocab(TINY, 1000)).tok_emb.weight.shape == (1000, TINY.d_model)


def _hf_config(**over):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500,
            "max_position_embeddings": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
    return {**base, **over}


def test_config_from_hf_reads_llama_configs_and_refuses_the_rest(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf_config()))
    cfg = config_from_hf(tmp_path)
    assert cfg == LlamaConfig(vocab_size=500, context=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=160,
                              rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True)
    path.write_text(json.dumps(_hf_config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4})))
    assert config_from_hf(path).rope_theta == 1e4  # transformers 5 writes rope_parameters
    path.write_text(json.dumps({k: v for k, v in _hf_config().items() if k != "tie_word_embeddings"}))
    assert config_from_hf(path).tie_embeddings is False  # Hugging Face's default
    for field, value in [("rope_scaling", {"rope_type": "llama3", "factor": 32.0}), ("attention_bias", True),
                         ("mlp_bias", True), ("model_type", "mistral"), ("hidden_act", "gelu"), ("head_dim", 32),
                         ("rope_parameters", {"rope_type": "yarn", "factor": 4.0})]:
        path.write_text(json.dumps(_hf_config(**{field: value})))
        with pytest.raises(ValueError, match=field):
            config_from_hf(path)
    with pytest.raises(ValueError, match="no config.json"):
        config_from_hf(tmp_path / "nowhere")


def test_hf_names_follow_the_parameter_order():
    names = hf_names(TINY)
    assert names[:3] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.self_attn.q_proj.weight"]
    assert names[-1] == "model.norm.weight" and len(names) == len(list(build_model(TINY).parameters()))
    assert hf_names(UNTIED)[-1] == "lm_head.weight"


@pytest.mark.parametrize("cfg", [TINY, UNTIED], ids=["tied", "untied"])
@pytest.mark.parametrize("count", [2, 3])
def test_stages_compose_to_the_whole_model(cfg, count):
    torch.manual_seed(7)
    full = build_model(cfg)
    stages = [Stage(cfg, i, count, seed=7) for i in range(count)]
    assert not any(hasattr(s, "pos_emb") for s in stages)
    x = torch.randint(0, cfg.vocab_size, (2, 20))
    y = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        _, expected = full(x, y)
        h = x
        for stage in stages[:-1]:
            h = stage(h)
        got = stages[-1](h, y)
    torch.testing.assert_close(got, expected)
    assert sum(p.numel() for s in stages for p in s.parameters()) == (
        full.num_params() + (cfg.vocab_size * cfg.d_model if cfg.tie_embeddings else 0))  # the head is untied across stages


def test_checkfree_rebuilds_and_restores_llama_stages():
    stages = [Stage(TINY, i, 4, seed=i + 10, plus=True) for i in range(4)]
    assert stages[1].can_embed and stages[2].can_head
    rebuilt = rebuild_stage(TINY, 1, 4, 0, "uniform", stages[0], stages[2])
    for (name, p), a, b in zip(rebuilt.blocks.named_parameters(), stages[0].blocks.parameters(), stages[2].blocks.parameters()):
        torch.testing.assert_close(p, (a + b) / 2, msg=name)
    first = restore_from_replica(TINY, 0, 4, 0, stages[1])
    assert torch.equal(first.tok_emb.weight, stages[1].tok_emb.weight)
    last = restore_from_replica(TINY, 3, 4, 0, stages[2])
    assert torch.equal(last.head.weight, stages[2].head.weight) and torch.equal(last.ln_f.weight, stages[2].ln_f.weight)
    x = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.no_grad():
        loss = last(stages[2](stages[1](first(x))), x)
    assert torch.isfinite(loss)


def test_gpt_is_unchanged_and_still_built_by_the_registry():
    cfg = preset("nano")
    assert type(build_model(cfg)) is GPT and isinstance(cfg, GPTConfig)
    names = [n for n, _ in GPT(cfg).named_parameters()]
    assert names[:3] == ["tok_emb.weight", "pos_emb.weight", "blocks.0.ln1.weight"] and names[-1] == "ln_f.bias"


def test_rotary_tables_are_computed_once_and_never_saved():
    """cos/sin live in non-persistent buffers: the state dict (checkpoints, exports) is the parameters alone,
    and a model built on the meta device (names and shapes only) builds them there too."""
    model = build_model(TINY)
    attn = model.blocks[0].self_attn
    assert attn.rope_cos.shape == (TINY.context, TINY.head_dim)
    assert not any("rope" in name for name in model.state_dict())
    cos, sin = rope_cos_sin(TINY.context, TINY.head_dim, TINY.rope_theta, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(attn.rope_cos, cos) and torch.testing.assert_close(attn.rope_sin, sin)
    with torch.device("meta"):
        meta = build_model(TINY)
    assert meta.blocks[0].self_attn.rope_cos.is_meta
