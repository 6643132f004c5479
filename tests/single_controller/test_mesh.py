import pytest

from rlframe.single_controller.mesh import Mesh


def test_megatron_order_tp_fastest():
    mesh = Mesh.of(tp=2, dp=2, pp=2)
    assert mesh.names == ("pp", "dp", "tp")
    assert [mesh.coords(r) for r in range(4)] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "tp": 0}, {"pp": 0, "dp": 1, "tp": 1},
    ]
    assert mesh.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert all(mesh.rank_of(**mesh.coords(r)) == r for r in range(8))


def test_world_size_error_shows_arithmetic():
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(2\) \* tp\(2\) = 8 != world size 4"):
        Mesh.of(pp=2, dp=2, tp=2).check_world_size(4)


def test_bad_dims():
    with pytest.raises(ValueError, match="unknown mesh dims"):
        Mesh.of(xp=2)
    with pytest.raises(ValueError, match="positive integers"):
        Mesh.of(dp=0)
