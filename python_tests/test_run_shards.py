"""The interpreter pass's sharding: conftest's MOE_KERNELS_TEST_SHARD selection and
python_tests/run_shards.py's exit status."""

import sys
import types

import pytest

from python_tests import conftest, run_shards


def _select(shard, n_items, monkeypatch):
    monkeypatch.setenv("MOE_KERNELS_TEST_SHARD", shard)
    deselected = []
    config = types.SimpleNamespace(hook=types.SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
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
