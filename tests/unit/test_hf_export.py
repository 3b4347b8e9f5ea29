"""Hugging Face interop: ``node export`` folders load in transformers with no custom code and give the same
logits; :func:`load_hf_folder` reads them (and transformers' own sharded folders) back exactly."""

import dataclasses
import json

import pytest
import torch

from node.checkpoints.checkpoint import save_atomic
from node.cli.app import main
from node.errors import UserError
from node.checkpoints.hf_export import export_checkpoint, load_hf_folder
from swarm.models.presets import build_model, preset, with_vocab

transformers = pytest.importorskip("transformers")

SENTENCES = ["To be, or not to be, that is the question.", "Whether 'tis nobler in the mind to suffer",
             "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"] * 8


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    return tok.to_str()


def _checkpoint(tmp_path, tokenizer_json, tied: bool, **extra):
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    cfg = with_vocab(dataclasses.replace(preset("llama-tiny"), n_layer=2, context=64, tie_embeddings=tied), vocab)
    torch.manual_seed(3)
    model = build_model(cfg)
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    phi = [p.detach().clone() for p in model.parameters()]
    state = {"format": 1, "model_config": cfg.to_dict(), "round": 7, "phi": phi,
             "theta": [t + 0.01 * torch.randn_like(t) for t in phi], "tokenizer": tokenizer_json,
             "settings": {"stages": 1}, **extra}
    path = save_atomic(state, tmp_path / "run" / "checkpoint.pt")
    return path, model.eval(), state


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, tokenizer_json, tied):
    path, model, state = _checkpoint(tmp_path, tokenizer_json, tied)
    out = export_checkpoint(path, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings is tied
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>" and hf.config.eos_token_id == tok.eos_token_id == 0
    ids = tok("To be, or not to be: the slings of fortune", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 5
    x = torch.cat([ids, torch.randint(0, model.cfg.vocab_size, (1, 64 - ids.shape[1]))], dim=1)
    with torch.no_grad():
        ours, _ = model(x)
        theirs = hf(input_ids=x).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    cfg, tensors, tok_text = load_hf_folder(out)
    assert cfg == model.cfg and tok_text == tokenizer_json
    assert len(tensors) == len(state["phi"]) and all(torch.equal(a, b) for a, b in zip(tensors, state["phi"]))


def test_theta_export_and_transformers_sharded_folders_read_back(tmp_path, tokenizer_json):
    path, _, state = _checkpoint(tmp_path, tokenizer_json, tied=False)
    out = export_checkpoint(path.parent, tmp_path / "hf", weights="theta")  # the checkpoint folder works too
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")  # transformers' own writer, several shards
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    cfg, tensors, tok_text = load_hf_folder(tmp_path / "sharded")
    assert cfg == build_model(cfg).cfg and tok_text is None
    assert all(torch.equal(a, b) for a, b in zip(tensors, state["theta"]))


def test_refusals_are_user_errors_naming_the_problem(tmp_path, tokenizer_json):
    gpt = save_atomic({"model_config": preset("nano").to_dict(), "phi": [], "round": 1}, tmp_path / "gpt.pt")
    with pytest.raises(UserError, match="byte-level GPT"):
        export_checkpoint(gpt, tmp_path / "out")
    path, _, _ = _checkpoint(tmp_path, tokenizer_json, tied=True, settings={"stages": 2})
    with pytest.raises(UserError, match="pipeline stage"):
        export_checkpoint(path, tmp_path / "out")
    path, _, _ = _checkpoint(tmp_path, tokenizer_json, tied=True)
    out = export_checkpoint(path, tmp_path / "out")
    with pytest.raises(UserError, match="not an empty folder"):
        export_checkpoint(path, out)
    from safetensors.torch import load_file, save_file

    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        load_hf_folder(out)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \[3, 3\]"):
        load_hf_folder(out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(UserError, match="rope_scaling"):
        load_hf_folder(out)


def test_node_export_command(tmp_path, tokenizer_json, capsys):
    path, _, _ = _checkpoint(tmp_path, tokenizer_json, tied=True)
    with pytest.raises(SystemExit) as done:
        main(["export", "--checkpoint", str(path), "--out", str(tmp_path / "hf"), "--weights", "theta"])
    assert done.value.code == 0 and (tmp_path / "hf" / "model.safetensors").is_file()
    assert "wrote" in capsys.readouterr().out
    gpt = save_atomic({"model_config": preset("tiny").to_dict(), "phi": [], "round": 1}, tmp_path / "gpt.pt")
    with pytest.raises(SystemExit) as done:
        main(["export", "--checkpoint", str(gpt), "--out", str(tmp_path / "hf2")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert done.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and "llama" in err[0]
    assert not (tmp_path / "hf2").exists()
