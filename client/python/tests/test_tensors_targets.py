# SPDX-License-Identifier: Apache-2.0
"""Targets that do not fit int64 (the wire's widest target dtype) are refused by the client,
naming the argument, the index and the value, instead of wrapping: uint64 2**64 - 100 cast to
int64 is -100, an ignore_index, and its row would silently not count. Needs no server."""

import numpy as np
import pytest

import lossd
from lossd._proto import pb
from lossd.tensors import INT_DTYPES, check_fits_int64, to_wire

BIG = 2**64 - 100  # int64(BIG) == -100 == the default ignore_index


def test_uint64_target_above_int64_is_refused_by_name_index_and_value():
    t = np.array([[1, 2, 3], [4, BIG, 6]], dtype=np.uint64)
    with pytest.raises(lossd.InvalidArgumentError) as e:
        to_wire(t, "targets", INT_DTYPES)
    assert isinstance(e.value, ValueError)
    assert "targets[1, 1] = %d does not fit int64" % BIG in str(e.value)
    assert "1 value(s) of uint64" in str(e.value)


def test_first_bad_index_of_a_flat_array_and_the_count():
    t = np.array([0, 2**63, 5, 2**64 - 1], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"labels\[1\] = 9223372036854775808 does not fit "
                                         r"int64.*2 value\(s\)"):
        check_fits_int64(t, "labels")


def test_unsigned_targets_that_fit_still_travel_as_int64():
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        top = 2**63 - 1 if dt is np.uint64 else np.iinfo(dt).max
        t = np.array([0, 7, top], dtype=dt)
        wire_dt, shape, arr = to_wire(t, "targets", INT_DTYPES)
        assert wire_dt == pb.DTYPE_INT64 and shape == (3,)
        assert arr.tolist() == [0, 7, int(top)]
    check_fits_int64(np.zeros((0,), np.uint64), "targets")  # empty: nothing to refuse


def test_compute_refuses_before_sending():
    """Client.compute converts its targets with to_wire: the refusal comes before any call
    (no server at this address)."""
    x = np.ones((2, 4), np.float32)
    w = np.ones((8, 4), np.float32)
    with lossd.Client("127.0.0.1:1", timeout=1.0) as c:
        with pytest.raises(lossd.InvalidArgumentError, match=r"targets\[0\] = %d" % BIG):
            c.compute(x, w, np.array([BIG, 3], np.uint64))


def test_torch_uint64_ids_in_lossd_rl_are_refused():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "uint64"):
        pytest.skip("this torch has no uint64")
    from lossd._rl_common import _int64

    ids = torch.tensor([[3, 4], [5, 6]], dtype=torch.int64).to(torch.uint64)
    ids[1, 0] = torch.tensor(-100, dtype=torch.int64).view(torch.uint64)  # 2**64 - 100
    with pytest.raises(lossd.InvalidArgumentError,
                       match=r"selected_token_ids\[1, 0\] = %d does not fit int64" % BIG):
        _int64(ids, "selected_token_ids")
    ok = torch.tensor([3, 4], dtype=torch.int64).to(torch.uint64)
    assert _int64(ok, "labels").tolist() == [3, 4]
