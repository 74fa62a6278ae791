"""Tests for dion_jax.accounting.replica_groups: the device groups of each format XLA
prints, against groups worked out by hand from the format's definition (the axes they
span on a mesh: ``tests/test_accounting_hlo.py::test_replica_group_formats``)."""
import pytest

from dion_jax.accounting.replica_groups import replica_groups


@pytest.mark.parametrize("text, groups", [
    ("{{0,4},{1,5}}", [[0, 4], [1, 5]]),
    ("{}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
    # iota: arange(8).reshape(2,2,2).transpose(0,2,1).reshape(4,2)
    ("[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    # device_ids arange(8).reshape(4,2).T.reshape(4,2) = [[0,2],[4,6],[1,3],[5,7]] laid out
    # as axis_0=4 x axis_1=2; a group per axis_1 index (a column)
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_0'}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    # the middle factor of a=8 (its digits pre=2, size 2): devices 2 apart
    ("mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
])
def test_groups_of_each_format(text, groups):
  got = replica_groups(f"channel_id=1, replica_groups={text}, to_apply=%add", "all-reduce", 8)
  assert sorted(map(sorted, got)) == groups


def test_collective_permute_pairs_are_its_groups():
  got = replica_groups("channel_id=2, source_target_pairs={{0,1},{1,0},{2,3}}", "collective-permute", 8)
  assert got == [[0, 1], [1, 0], [2, 3]]
