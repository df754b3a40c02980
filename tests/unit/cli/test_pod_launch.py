"""``--pod-ranks`` and the variables torchrun sets: where a process sits in its pod."""

from __future__ import annotations

import pytest

from p2ptrain.cli.pod_launch import DEFAULT_POD_TIMEOUT_S, pod_from_environment, without_pod_ranks
from p2ptrain.errors import LocalError


def test_a_process_outside_torchrun_is_in_no_pod() -> None:
    assert pod_from_environment({"PATH": "/bin"}, timeout_s=None) is None


def test_torchrun_variables_place_the_process() -> None:
    environ = {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    pod = pod_from_environment(environ, timeout_s=None)
    assert pod is not None
    assert (pod.rank, pod.world_size, pod.local_rank, pod.restart) == (1, 2, 1, 2)
    assert pod.agent_store == ("127.0.0.1", 29500)
    assert pod.timeout_s == DEFAULT_POD_TIMEOUT_S
    assert pod_from_environment({**environ, "TORCHELASTIC_USE_AGENT_STORE": "False"}, timeout_s=5)


def test_missing_torchrun_variables_say_how_to_start_a_pod() -> None:
    with pytest.raises(LocalError, match="--pod-ranks N"):
        pod_from_environment({"LOCAL_RANK": "0"}, timeout_s=None)


def test_the_relaunched_command_has_no_pod_ranks() -> None:
    argv = ["-v", "train", "--pod-ranks", "2", "--dir", "d", "--pod-ranks=3", "--json"]
    assert without_pod_ranks(argv) == ["-v", "train", "--dir", "d", "--json"]
