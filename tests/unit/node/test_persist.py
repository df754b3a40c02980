"""What a node persists (chain links, votes, trainer state), its settings, and the early close
of a full window."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from p2ptrain.aggregate.codecs import make_encoder
from p2ptrain.cli.node_commands import _config, _listen, settings_from
from p2ptrain.core.tensors import schema_of
from p2ptrain.errors import LocalError
from p2ptrain.node.persist import NodeStore
from p2ptrain.node.setup import NodeSettings
from p2ptrain.protocol import actions as act
from p2ptrain.protocol.ballot import Ballot
from p2ptrain.protocol.chain import HeadChain
from p2ptrain.protocol.participant import Participant
from p2ptrain.protocol.retention import DEFAULT_KEEP_HEADS
from p2ptrain.protocol.trainer import TrainerMachine
from p2ptrain.sim.workloads import SyntheticWorkload
from p2ptrain.store.datadir import DataDir
from tests.support.builders import (
    certified_chain,
    experiment,
    h,
    identity,
    synthetic_experiment,
)


def test_links_round_trip_and_verify_again(tmp_path: Path) -> None:
    validators = [identity(i) for i in range(3)]
    manifest = experiment(validators, 2)
    chain = certified_chain(manifest, validators[:2], 4)
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        for height in range(1, 5):
            link = chain.at(height)
            assert link is not None and link.certificate is not None
            store.put_link(link.head, link.certificate)
            store.put_link(link.head, link.certificate)  # idempotent
        links = store.links(manifest.id)
    assert [head.height for head, _ in links] == [1, 2, 3, 4]
    fresh = HeadChain(manifest)
    assert fresh.catch_up(links, weights_ok=lambda head: True)
    assert fresh.tip.head_id == chain.tip.head_id


def test_votes_survive_and_old_ones_are_dropped(tmp_path: Path) -> None:
    def ballot(height: int) -> Ballot:
        head = h(f"head-{height}")
        return Ballot(round=height % 3, prevote=head, commit=None, lock=head, lock_round=0)

    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        for height in range(1, 80):
            store.put_vote(height, ballot(height))
    with DataDir(tmp_path) as datadir:
        votes = NodeStore(datadir).votes()
    assert len(votes) == 64 and votes[79] == ballot(79) and 1 not in votes


def test_an_unreadable_stored_vote_names_the_directory_and_what_to_do(tmp_path: Path) -> None:
    with DataDir(tmp_path) as datadir:
        datadir.state.set_meta("votes", b'{"3": "{\\"round\\": \\"x\\"}"}')
        with pytest.raises(LocalError, match=r"votes at height 3.*new data directory"):
            NodeStore(datadir).votes()


def test_trainer_state_round_trip(tmp_path: Path) -> None:
    tensors = {"w/exp_avg": torch.arange(6.0).reshape(2, 3), "w/step": torch.tensor(7.0)}
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        assert store.load_trainer_state() is None
        store.save_trainer_state(tensors, {"window": "3"})
        loaded = store.load_trainer_state()
    assert loaded is not None
    assert loaded[1]["window"] == "3"
    assert torch.equal(loaded[0]["w/exp_avg"], tensors["w/exp_avg"])


def test_a_data_directory_follows_one_experiment(tmp_path: Path) -> None:
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        store.remember_experiment(h("one"))
        store.remember_experiment(h("one"))
        with pytest.raises(LocalError, match="use another --dir"):
            store.remember_experiment(h("two"))


def test_settings_take_several_roles_and_refuse_bad_ones(tmp_path: Path) -> None:
    both = NodeSettings(data_dir=tmp_path, roles=("trainer", "validator", "trainer"))
    assert both.roles == ("trainer", "validator") and both.max_role_failures == 3
    with pytest.raises(LocalError, match="choose one or more of"):
        NodeSettings(data_dir=tmp_path, roles=("miner",))
    with pytest.raises(LocalError, match="choose one or more of"):
        NodeSettings(data_dir=tmp_path, roles=())
    with pytest.raises(LocalError, match="--max-role-failures 0: use 1 or more"):
        NodeSettings(data_dir=tmp_path, roles=("trainer",), max_role_failures=0)
    with pytest.raises(LocalError, match="add --role seed"):
        NodeSettings(data_dir=tmp_path, roles=("trainer",), experiment_toml=tmp_path / "e")
    with pytest.raises(LocalError, match="64 hex"):
        NodeSettings(data_dir=tmp_path, roles=("trainer",), experiment_id="abc")
    assert both.keep_heads == DEFAULT_KEEP_HEADS and not both.archive
    assert NodeSettings(data_dir=tmp_path, roles=("viewer",), keep_heads=1).keep_heads == 1
    with pytest.raises(LocalError, match="--keep-heads 0: use 1 or more"):
        NodeSettings(data_dir=tmp_path, roles=("viewer",), keep_heads=0)


def test_cli_settings_from_toml_and_flags(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text('bootstrap = ["http://s:7700"]\nlisten = "0.0.0.0:7701"\nthreads = 2\n')
    args = argparse.Namespace(
        config=str(config), dir=str(tmp_path / "d"), experiment=h("x"), bootstrap=None,
        listen="127.0.0.1:0", advertise=None, relay=None, secret_file=None, windows=3,
        threads=None, mdns=None, network_name=None, experiment_toml=None, roles=["validator"],
        max_role_failures=None, data_dir_default="p2ptrain-data",
    )  # fmt: skip
    settings = settings_from(args)
    assert settings.bootstrap == ("http://s:7700",)
    assert (settings.host, settings.port) == ("127.0.0.1", 0)  # the flag wins
    assert settings.threads == 2 and settings.windows == 3 and settings.roles == ("validator",)
    # `p2ptrain node`: roles from the config when no --role is given; a trainer that also
    # validates listens by default
    config.write_text('role = ["trainer", "validator"]\nmax_role_failures = 5\n')
    several = settings_from(argparse.Namespace(**{**vars(args), "roles": None, "listen": None}))
    assert several.roles == ("trainer", "validator") and several.max_role_failures == 5
    assert several.host == "127.0.0.1"
    assert settings.keep_heads == DEFAULT_KEEP_HEADS
    config.write_text('role = ["viewer"]\nkeep_heads = 5\narchive = true\n')
    kept = settings_from(argparse.Namespace(**{**vars(args), "roles": None}))
    assert (kept.keep_heads, kept.archive) == (5, True)
    flagged = settings_from(argparse.Namespace(**{**vars(args), "keep_heads": 2}))
    assert flagged.keep_heads == 2  # the flag wins
    config.write_text("")
    with pytest.raises(LocalError, match="give the node its roles"):
        settings_from(argparse.Namespace(**{**vars(args), "roles": None}))
    config.write_text("bootstrapp = []\n")
    with pytest.raises(LocalError, match="unknown setting"):
        _config(str(config))
    assert _listen("none") == (None, 0)
    with pytest.raises(LocalError, match="HOST:PORT"):
        _listen("7700")


@pytest.mark.parametrize("max_updates", [2, 3])
def test_a_full_window_closes_before_its_deadline(max_updates: int) -> None:
    workload = SyntheticWorkload(seed=1)
    validator = identity(0)
    manifest = synthetic_experiment(workload, validator.public_key, max_updates=max_updates)
    genesis = workload.genesis()
    participant = Participant(manifest, validator, genesis, validator=True, reducers=(), now=0.0)
    for n in range(2):
        trainer = TrainerMachine(manifest, identity(10 + n), genesis)
        (train,) = trainer.start(0.0)
        assert isinstance(train, act.Train)
        delta, before, after = workload.train(genesis, trainer.lease(1), n, 1)
        blob = make_encoder(manifest.codec, schema_of(genesis)).encode(delta)
        (send,) = trainer.finish(1, train.base_head, blob, before, after)
        assert isinstance(send, act.SendUpdate)
        actions = participant.receive_update(1.0 + n, send.update, send.blob)
    proposed = [a for a in actions if isinstance(a, act.SendProposal)]
    if max_updates == 2:  # full: proposed and certified at t=2, not at t=101
        assert proposed and participant.chain.height == 1  # a new window is open
    else:  # the deadline: 100 s after the first update
        assert not proposed and participant.next_wakeup(2.0) == pytest.approx(101.0)


def test_a_window_whose_training_never_ended_is_reported_once(tmp_path: Path) -> None:
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        assert store.interrupted_training() is None
        store.begin_training(5)
        store.end_training()
        assert store.interrupted_training() is None
        store.begin_training(6)  # and the process is killed here
    with DataDir(tmp_path) as datadir:
        store = NodeStore(datadir)
        assert store.interrupted_training() == 6
        assert store.interrupted_training() is None
