"""serve/model.py: the pure parts of the served model (buckets, the bounds an
artifact's parameter tensors give, the validated-input records); a served
artifact end to end is in test_serve.py and test_serve_hardening.py."""

import dataclasses
import types

import numpy as np
import pytest

from jaxfold._src.serve.model import InputError, InputSpec, pow2_buckets, program_bounds


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


def test_program_bounds_from_the_embedding_tables():
  fn = _artifact(("params/wte/embedding", [96, 32]), ("params/wpe/embedding", [64, 32]),
                 ("params/h_0/attn/c_attn/kernel", [32, 96]))
  assert program_bounds(fn) == {"vocab": 96, "positions": 64, "token_types": None}
  bert = _artifact(("embeddings/word_embeddings/embedding", [120, 8]),
                   ("embeddings/position_embeddings/embedding", [40, 8]),
                   ("embeddings/token_type_embeddings/embedding", [2, 8]))
  assert program_bounds(bert) == {"vocab": 120, "positions": 40, "token_types": 2}


def test_program_bounds_ignores_what_is_not_a_table():
  fn = _artifact(("rel_pos/relative_position_embedding", [31, 4]),   # relative: not a bound
                 ("wte/embedding", [96, 32, 1]),                        # not 2-D
                 ("decoder/embed_tokens", [50, 8]), ("encoder/embed_tokens", [40, 8]))
  assert program_bounds(fn) == {"vocab": 40, "positions": None, "token_types": None}   # the smaller table
  assert program_bounds(types.SimpleNamespace()) == {"vocab": None, "positions": None, "token_types": None}


def test_input_spec_is_a_frozen_record_and_input_error_a_value_error():
  s = InputSpec("input_ids", np.dtype("int32"), ("batch", "seq"), 0, 96)
  assert (s.low, s.high, s.role) == (0, 96, None)
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.high = 100
  assert issubclass(InputError, ValueError)
