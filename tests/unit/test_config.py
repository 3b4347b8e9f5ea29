"""Configuration: flags > LOCOMESH_* env > --config TOML > defaults, and clear errors for bad values."""

import pytest
import typer

from node.cli.app import parse_join_args
from node.config import ConfigError, NodeConfig, load_config


def test_defaults():
    cfg = parse_join_args([])
    assert cfg == NodeConfig()
    assert cfg.inner_steps == "auto" and cfg.round_steps is None and cfg.median_steps(2) == 50 and cfg.outer_hyper == (1.0, 0.7) and cfg.algorithm == "diloco" and cfg.codec == "none"


def test_algorithm_defaults_follow_the_papers():
    noloco = parse_join_args(["--algorithm", "noloco"])
    # NoLoCo steps with β = γ = 1 (measured on tiny, 4 nodes: see NodeConfig.outer_hyper)
    assert noloco.outer_hyper == (1.0, 0.5) and noloco.group_size == 2 and noloco.codec == "none"
    sparse = parse_join_args(["--algorithm", "sparseloco"])
    # SparseLoCo steps at η = 2 (measured on tiny, 4 nodes: see NodeConfig.outer_hyper)
    assert sparse.outer_hyper == (2.0, 0.0) and sparse.codec == "topk:64/4096+q2" and sparse.feedback_decay() == 0.95
    # an explicit value always wins over the algorithm's default
    assert parse_join_args(["--algorithm", "sparseloco", "--compression", "q4", "--outer-lr", "0.5"]).outer_hyper == (0.5, 0.0)
    assert parse_join_args(["--algorithm", "sparseloco", "--compression", "q4"]).codec == "q4"
    # a shared-seed projection already accumulates in its error feedback: no outer momentum on top
    assert parse_join_args(["--compression", "seed:r=8"]).outer_hyper == (1.0, 0.0)
    assert parse_join_args(["--compression", "seed:r=8", "--outer-momentum", "0.5"]).outer_hyper == (1.0, 0.5)
    # other lossy codecs: half the momentum at lr 1 (error feedback already carries what was dropped)
    assert parse_join_args(["--compression", "rot2"]).outer_hyper == (1.0, 0.5)
    assert parse_join_args(["--compression", "bf16"]).outer_hyper == (1.0, 0.7)
    assert parse_join_args(["--algorithm", "noloco", "--compression", "q2"]).outer_hyper == (1.0, 0.5)
    # sparse rounds are cheap: SparseLoCo syncs more often (by replica count, at the median's speed) unless
    # told otherwise, and NoLoCo's pairs too (its paper syncs at half DiLoCo's interval)
    assert (sparse.inner_steps, sparse.round_steps, sparse.median_steps(2), noloco.inner_steps) == ("auto", None, 15, 30)
    assert parse_join_args(["--algorithm", "sparseloco", "--inner-steps", "12"]).inner_steps == 12
    assert parse_join_args(["--algorithm", "sparseloco", "--inner-steps", "by-replicas"]).steps_for(8) == 10
    assert parse_join_args(["--algorithm", "noloco", "--inner-steps", "auto"]).round_steps == 30


def test_streaming_and_auto_steps_options():
    cfg = parse_join_args(["--fragments", "4", "--overlap", "--overlap-mode", "delayed", "--inner-steps", "auto", "--round-steps", "40"])
    assert cfg.fragments == 4 and cfg.overlap and cfg.overlap_mode == "delayed"
    assert cfg.inner_steps == "auto" and cfg.round_steps == 40
    assert parse_join_args(["--inner-steps", "AUTO"]).inner_steps == "auto"
    assert parse_join_args(["--inner-steps", "12"]).inner_steps == 12


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inner-steps", "soon"], "number of steps, 'auto' or 'by-replicas'"),
        (["--algorithm", "noloco", "--inner-steps", "by-replicas"], "by-replicas sizes diloco's and sparseloco's rounds"),
        (["--inner-steps", "0"], "[1, 1000000]"),
        (["--algorithm", "noloco", "--fragments", "2"], "noloco sends whole models"),
        (["--fragments", "4", "--inner-steps", "3"], "at least as many inner steps"),
        (["--fragments", "3", "--model", "nano"], "only 2 blocks"),
        (["--algorithm", "allreduce"], "--algorithm"),
        (["--group-size", "1"], "--group-size"),
        (["--overlap-mode", "eventually"], "--overlap-mode"),
        (["--stages", "2", "--min-peers", "2"], "--min-peers holds whole-model replicas (--stages 1)"),
    ],
)
def test_bad_algorithm_settings_are_named(args, message):
    with pytest.raises((ConfigError, typer.Exit, SystemExit)) as err:
        load_config(dict(zip([a.lstrip("-").replace("-", "_") for a in args[::2]], args[1::2])))
    assert message in str(err.value)


def test_every_replica_algorithm_takes_min_peers():
    for algorithm in ("diloco", "noloco", "sparseloco", "zo"):
        assert parse_join_args(["--algorithm", algorithm, "--min-peers", "3"]).min_peers == 3


def test_precedence_flag_over_env_over_file(tmp_path, monkeypatch):
    toml = tmp_path / "node.toml"
    toml.write_text('inner-steps = 7\nbatch_size = 3\nlr = 0.5\nrun-id = "from-file"\n')
    monkeypatch.setenv("LOCOMESH_BATCH_SIZE", "5")
    monkeypatch.setenv("LOCOMESH_LR", "0.25")
    cfg = parse_join_args(["--config", str(toml), "--lr", "0.125"])
    assert cfg.inner_steps == 7  # file only
    assert cfg.batch_size == 5  # env over file
    assert cfg.lr == 0.125  # flag over env
    assert cfg.run_id == "from-file"
    assert cfg.model == "tiny"  # default


def test_config_file_from_env_and_node_table(tmp_path, monkeypatch):
    toml = tmp_path / "node.toml"
    toml.write_text('[node]\nmodel = "nano"\ninitial-peers = ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]\n')
    monkeypatch.setenv("LOCOMESH_CONFIG", str(toml))
    cfg = parse_join_args([])
    assert cfg.model == "nano" and cfg.initial_peers == ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]


def test_repeatable_flags():
    cfg = parse_join_args(["--initial-peers", "/ip4/1.2.3.4/tcp/1", "--initial-peers", "/ip4/1.2.3.5/tcp/2"])
    assert cfg.initial_peers == ["/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.5/tcp/2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inner-steps", "0"], "--inner-steps"),
        (["--model", "gigantic"], "unknown model preset 'gigantic'"),
        (["--outer-momentum", "1.5"], "--outer-momentum"),
        (["--initial-peers", "localhost:1234"], "is not a multiaddr"),
        (["--device", "tpu"], "--device"),
        (["--run-id", "has space"], "--run-id"),
        (["--compression", "topk:0/4096"], "Valid forms"),
        (["--compression", "zip"], "invalid codec spec 'zip'"),
        (["--error-feedback-decay", "1.5"], "--error-feedback-decay"),
    ],
)
def test_bad_values_fail_with_the_option_named(args, message, capsys):
    with pytest.raises(typer.Exit) as e:
        parse_join_args(args)
    assert e.value.exit_code == 2
    assert message in capsys.readouterr().err


def test_codec_spec_is_canonicalised_and_feedback_defaults():
    assert parse_join_args(["--compression", "int8-block:4096"]).compression == "int8-block"
    assert parse_join_args(["--compression", "topk:64/4096+q2"]).feedback_decay() == 0.95
    assert parse_join_args([]).feedback_decay() == 0.0
    assert parse_join_args(["--compression", "q2", "--error-feedback-decay", "0"]).feedback_decay() == 0.0


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({}, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("inner-steps = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config({}, bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("inner_stepz = 3")
    with pytest.raises(ConfigError, match="inner-stepz"):
        load_config({}, unknown)


def test_non_numeric_flag_is_a_usage_error(capsys):
    with pytest.raises(typer.Exit):
        parse_join_args(["--inner-steps", "many"])
    assert "--inner-steps" in capsys.readouterr().err


def test_a_round_writes_the_checkpoint_after_the_first_round_then_every_checkpoint_every_seconds(monkeypatch):
    """Every round wrote the whole state (θ, φ, both optimizers: ~3 GB at 150 M parameters) and training
    stood still meanwhile; now the first round's end writes it, then one every --checkpoint-every seconds
    (0: every round), and stopping always does."""
    from types import SimpleNamespace

    from node.runtime import base

    now = [1000.0]
    monkeypatch.setattr(base.time, "monotonic", lambda: now[0])
    node = SimpleNamespace(cfg=NodeConfig(checkpoint_every=300), last_checkpoint=None)
    due = lambda: base.NodeBase._checkpoint_due(node)  # noqa: E731
    assert due()  # the first round
    node.last_checkpoint = now[0]
    now[0] += 299
    assert not due()
    now[0] += 1
    assert due()
    node.cfg = NodeConfig(checkpoint_every=0)
    assert due()
    assert NodeConfig().checkpoint_every == 300
