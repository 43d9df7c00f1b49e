"""The passes' sharding: conftest's MOE_KERNELS_TEST_SHARD selection and test claims, and
python_tests/run_shards.py's exit status and checks."""

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from python_tests import conftest, run_shards


def _select(shard, n_items, monkeypatch):
    monkeypatch.setenv("MOE_KERNELS_TEST_SHARD", shard)
    deselected = []
    config = types.SimpleNamespace(
        hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)), stash=pytest.Stash()
    )
    items = list(range(n_items))
    conftest._keep_shard(config, items)
    return items, deselected


def test_shards_partition_the_tests(monkeypatch):
    kept = [_select(f"{i}/3", 10, monkeypatch)[0] for i in range(3)]
    assert kept == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    items, deselected = _select("1/3", 10, monkeypatch)
    assert sorted(items + deselected) == list(range(10))
    with pytest.raises(pytest.UsageError):
        _select("3/3", 10, monkeypatch)


def test_run_shards_fails_if_any_shard_fails(capsys):
    ok = [sys.executable, "-c", "import os; print('shard', os.environ['MOE_KERNELS_TEST_SHARD'])"]
    assert run_shards.main(["2", "--", *ok]) == 0
    out = capsys.readouterr().out
    assert "shard 0/2" in out and "shard 1/2" in out
    one_fails = [sys.executable, "-c", "import os, sys; sys.exit(os.environ['MOE_KERNELS_TEST_SHARD'] == '1/2')"]
    assert run_shards.main(["2", "--", *one_fails]) == 1
    assert run_shards.main(["2"]) == 2  # no command


def test_claims_give_each_test_to_one_process(tmp_path):
    """Processes claiming in turn, each from where it stands, never get the same index, and
    together get them all."""
    got = {0: [], 1: [], 2: []}
    position = {p: 0 for p in got}
    while True:
        progressed = False
        for p in got:
            j = conftest.claim(str(tmp_path), position[p], 10)
            if j is not None:
                got[p].append(j)
                position[p] = j + 1
                progressed = True
        if not progressed:
            break
    assert sorted(sum(got.values(), [])) == list(range(10))


def test_check_claims_finds_differing_collections_and_unrun_tests(tmp_path, capsys):
    assert run_shards.check_claims(str(tmp_path)) == 0  # no pytest ran: nothing to check
    (tmp_path / "collected-aaa").write_text("3")
    for j in (0, 2):
        (tmp_path / str(j)).touch()
    assert run_shards.check_claims(str(tmp_path)) == 1
    assert "1 of 3 collected tests were not run" in capsys.readouterr().out
    (tmp_path / "1").touch()
    assert run_shards.check_claims(str(tmp_path)) == 0
    (tmp_path / "collected-bbb").write_text("3")
    assert run_shards.check_claims(str(tmp_path)) == 1


def test_run_shards_runs_each_test_once():
    """Two processes of a real pytest pass (one small module) run, between them, every test
    that one process runs, each once."""
    root = Path(__file__).resolve().parents[1]
    module = "python_tests/backends/test_device_axis.py"
    command = [sys.executable, "-m", "pytest", module, "-p", "no:cacheprovider", "-q", "-rA"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_KERNELS_TEST_")}
    single = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    sharded = subprocess.run(
        [sys.executable, "python_tests/run_shards.py", "2", "--", *command],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert single.returncode == 0 and sharded.returncode == 0, single.stdout + sharded.stdout

    def passed(out):
        return sorted(re.findall(r"^PASSED (\S+)", out, flags=re.M))

    def skipped(out):
        return sum(int(n) for n in re.findall(r"(\d+) skipped", out))

    assert passed(single.stdout) and passed(sharded.stdout) == passed(single.stdout)
    assert skipped(sharded.stdout) == skipped(single.stdout)
    assert sharded.stdout.count("===== shard") == 2
