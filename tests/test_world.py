"""The MPI world: roles, nodes and communicators with real mpirun ranks on emulated nodes."""

import json
import subprocess
import sys

from mpi_progs.launch import PROGS, REPO, mpi_env, mpirun, node_blocks, write_config

ENTRY = ["-m", "rollout_hpc.runtime.entry", "--run-dir"]


def _hello(tmp_path, overrides, blocks_for=node_blocks):
    cfg = write_config(tmp_path, ["run.program=hello", *overrides])
    res = mpirun(blocks_for(cfg, [*ENTRY, str(tmp_path)]))
    assert res.returncode == 0, res.stdout + res.stderr
    facts = [json.loads((tmp_path / "hello" / f"rank-{r}.json").read_text()) for r in range(cfg.world_size)]
    return cfg, res, facts


def test_hello_six_ranks_on_four_emulated_nodes(tmp_path):
    cfg, res, facts = _hello(
        tmp_path, ["generator.nodes=2", "generator.tasks_per_node=1", "trainer.nodes=2", "trainer.tasks_per_node=2"]
    )
    hello_lines = [l for l in res.stdout.splitlines() if l.startswith("HELLO rank=")]
    assert len(hello_lines) == 6
    assert res.stdout.count("HELLO-EXCHANGE ok") == 2
    assert [f["role"] for f in facts] == ["generator"] * 2 + ["trainer"] * 4
    assert [f["group_rank"] for f in facts] == [0, 1, 0, 1, 2, 3]
    assert [f["node"] for f in facts] == ["gen0", "gen1", "train0", "train0", "train1", "train1"]
    assert [f["node_index"] for f in facts] == [0, 1, 0, 0, 1, 1]
    assert [f["local_rank"] for f in facts] == [0, 0, 0, 1, 0, 1]
    assert [f["is_node_leader"] for f in facts] == [True, True, True, False, True, False]
    assert [f["inter_remote_size"] for f in facts] == [4, 4, 2, 2, 2, 2]
    assert len({f["job_id"] for f in facts}) == 1
    # The round trip happened between the two group leaders.
    assert facts[0]["exchange"] == {"ok": True, "peer_rank": 2}
    assert facts[2]["exchange"] == {"ok": True, "peer_rank": 0}
    for line, f in zip(sorted(hello_lines, key=lambda l: int(l.split()[1].split("=")[1])), facts):
        assert f"role={f['role']}" in line and f"node={f['node']}" in line


def test_communicators_span_the_right_ranks(tmp_path):
    cfg = write_config(
        tmp_path, ["generator.nodes=1", "generator.tasks_per_node=2", "trainer.nodes=2", "trainer.tasks_per_node=1"]
    )
    res = mpirun(node_blocks(cfg, [str(PROGS / "world_comms.py"), str(tmp_path)]))
    assert res.returncode == 0, res.stdout + res.stderr
    out = [json.loads((tmp_path / f"comms-{r}.json").read_text()) for r in range(4)]
    assert [o["group_world_ranks"] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o["node_world_ranks"] for o in out] == [[0, 1], [0, 1], [2], [3]]
    assert all(len(set(o["node_names_on_node_comm"])) == 1 for o in out)
    assert [o["remote_group_size"] for o in out] == [2, 2, 2, 2]
    assert all(o["generator_leaders"] == [0] and o["trainer_leaders"] == [2, 3] for o in out)
    # Point-to-point over the intercommunicator reaches the other group, addressed by group rank.
    assert out[0]["received_from_remote"] == [2] and out[1]["received_from_remote"] == [3]
    assert out[2]["received_from_remote"] == [0] and out[3]["received_from_remote"] == [1]


def test_hostname_is_the_node_without_emulation(tmp_path):
    # No ROLLOUT_NODE: every rank is on this host; generators and trainers still get separate node comms.
    def plain(cfg, argv):
        return [(cfg.world_size, None, argv)]

    _, _, facts = _hello(tmp_path, ["generator.tasks_per_node=2", "trainer.tasks_per_node=2"], plain)
    assert len({f["node"] for f in facts}) == 1
    assert [f["local_rank"] for f in facts] == [0, 1, 0, 1]
    assert [f["local_size"] for f in facts] == [2, 2, 2, 2]


def test_world_size_mismatch_is_a_clear_error(tmp_path):
    write_config(tmp_path, ["run.program=hello", "trainer.tasks_per_node=2"])
    res = mpirun([(2, None, [*ENTRY, str(tmp_path)])])
    assert res.returncode != 0
    assert "the MPI world has 2 ranks, but the config needs" in res.stderr and "= 3" in res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.count("rollout-hpc: error:") == 1


def test_node_count_mismatch_is_a_clear_error(tmp_path):
    write_config(tmp_path, ["run.program=hello", "trainer.nodes=2"])
    res = mpirun([(1, "gen0", [*ENTRY, str(tmp_path)]), (2, "train0", [*ENTRY, str(tmp_path)])])
    assert res.returncode != 0
    assert "trainer.nodes is 2 but the trainer ranks run on 1 node(s)" in res.stderr
    assert "Traceback" not in res.stderr


def test_missing_run_dir_config_is_a_clear_error(tmp_path):
    res = subprocess.run(
        [sys.executable, *ENTRY, str(tmp_path / "nope")], env=mpi_env(), capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 2
    assert "config.resolved.yaml not found" in res.stderr and "Traceback" not in res.stderr
