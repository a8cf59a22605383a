"""rules/contracts.py: the facet Protocols agree with the code that implements and calls them.

Runtime does not use the Protocols, so nothing else notices when they drift:
every facet a registered rule carries must accept the Protocol's arguments,
and ``analysis.Level`` must implement every method and attribute of
``Context`` (and ``collect`` of ``BodyContext``)."""

import dataclasses
import inspect
import re

import pytest

from jaxfold._src import analysis
from jaxfold._src.rules import all_rules, call_rules
from jaxfold._src.rules import base as B
from jaxfold._src.rules import contracts as C


def _protocol_of(field: dataclasses.Field):
  """The contracts Protocol named by a ``Rule`` field's annotation (a string), or None."""
  m = re.search(r"\bC\.(\w+)", str(field.type))
  return getattr(C, m.group(1)) if m else None


def _arity(protocol) -> tuple:
  """(required positional parameters, all positional parameters) of its ``__call__``."""
  params = list(inspect.signature(protocol.__call__).parameters.values())[1:]   # without self
  req = [p for p in params if p.default is inspect.Parameter.empty]
  return len(req), len(params)


FACETS = [(f.name, _protocol_of(f)) for f in dataclasses.fields(B.Rule) if _protocol_of(f) is not None]


def test_the_rule_fields_are_typed_by_the_protocols():
  names = {n for n, _ in FACETS}
  assert {"facts", "canon", "shift", "zero_sum", "simplify", "rotate", "sums", "sum_axes", "contraction",
          "cast", "bodies", "inline", "body_facts", "body_zero_sum", "shift_inside", "rebind"} <= names


def _accepts(fn, n: int) -> bool:
  try:
    inspect.signature(fn).bind(*range(n))
  except TypeError:
    return False
  except ValueError:     # a builtin without a signature: cannot tell
    return True
  return True


@pytest.mark.parametrize("facet, protocol", FACETS, ids=[n for n, _ in FACETS])
def test_every_registered_facet_accepts_the_protocols_arguments(facet, protocol):
  req, _ = _arity(protocol)
  bad = []
  for rule in list(all_rules()) + list(call_rules()) + [B.DEFAULT]:
    fn = getattr(rule, facet)
    if fn is not None and not _accepts(fn, req):
      bad.append(f"{rule.name}.{facet}{inspect.signature(fn)}")
  assert not bad, f"facets not callable as {protocol.__name__} ({req} arguments): {bad}"


def test_level_implements_the_context():
  hints = C.Context.__annotations__
  members = [n for n, v in vars(C.Context).items() if callable(v) and not n.startswith("_")]
  assert {"facts", "canon", "atom", "body", "assuming", "round_to"} <= set(members)
  missing = [n for n in members + list(C.BodyContext.__dict__) if not n.startswith("_")
             and not hasattr(analysis.Level, n)]
  assert not missing, f"analysis.Level lacks {missing}"
  for name in members:
    proto = [p for p in inspect.signature(getattr(C.Context, name)).parameters if p != "self"]
    impl = [p for p in inspect.signature(getattr(analysis.Level, name)).parameters if p != "self"]
    assert impl[:len(proto)] == proto, (name, proto, impl)
  for attr in hints:                     # cbwc, tolerance, overrides: set on every Level
    assert attr in inspect.getsource(analysis.Level), attr
