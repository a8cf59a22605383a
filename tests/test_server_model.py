"""serve/model.py: the pure parts of the served model (buckets, the bounds an
artifact's parameter tensors give, the validated-input records); a served
artifact end to end is in test_serve.py and test_serve_hardening.py."""

import dataclasses
import types

import numpy as np
import pytest

from jaxfold._src.server.model import InputError, InputSpec, pow2_buckets


@pytest.mark.parametrize("limit, start, want", [
    (16, 1, (1, 2, 4, 8, 16)), (12, 1, (1, 2, 4, 8, 12)), (16, 4, (4, 8, 16)), (1, 1, (1,)),
    (5, 0, (1, 2, 4, 5)), (3, 8, (3,)),
])
def test_pow2_buckets(limit, start, want):
  got = pow2_buckets(limit, start)
  assert got == want
  assert list(got) == sorted(set(got)) and limit in got


def _artifact(*tensors):
  return types.SimpleNamespace(header={"weights": {"tensors": [{"name": n, "shape": s} for n, s in tensors]}})


def test_input_spec_is_a_frozen_record_and_input_error_a_value_error():
  s = InputSpec("input_ids", np.dtype("int32"), ("batch", "seq"), 0, 96)
  assert (s.low, s.high, s.role) == (0, 96, None)
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.high = 100
  assert issubclass(InputError, ValueError)
