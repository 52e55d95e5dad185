"""Where a rank comes from: launcher environments, the mapping's device, init_world's checks."""
from __future__ import annotations

import pytest

from kiln.distributed import init_world, launch_env, world
from kiln.errors import ConfigError
from kiln.mapping import Mapping


@pytest.mark.parametrize("environ, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, ("torchrun", 3, 4, 1)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     ("mpirun (Open MPI)", 1, 2, 0)),
    ({"PMI_RANK": "5", "PMI_SIZE": "8"}, ("PMI (MPICH, Slurm)", 5, 8, 5)),
])
def test_launchers_environments(environ, expected):
    env = launch_env(environ)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == expected


def test_no_launcher_and_bad_values():
    assert launch_env({}) is None
    with pytest.raises(ConfigError, match="RANK='x'"):
        launch_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_mapping_places_ranks():
    m = Mapping(world_size=8, tp_size=2, pp_size=4, rank=5, gpus_per_node=4)
    assert (m.tp_rank, m.pp_rank, m.local_rank, m.device) == (1, 2, 1, "cpu")
    assert list(m.pp_layers(10)) == [6, 7]


def test_init_world_refuses_what_cannot_be(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="no rank given and no launcher environment"):
        init_world(tp_size=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="started 4 processes, but tp_size 2 x pp_size 1 needs 2"):
        init_world(tp_size=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="set MASTER_ADDR and MASTER_PORT"):
        init_world(tp_size=2)
    assert world() is None
