"""The registry of exact per-primitive rules (one module per family).

Importing this package registers every rule; ``rule_for(primitive)`` gives a
primitive's rule, or the fail-closed default for primitives without one.
"""

from jaxfold._src.rules import contraction as contraction  # noqa: F401 (registers)
from jaxfold._src.rules import control as control  # noqa: F401
from jaxfold._src.rules import elementwise as elementwise  # noqa: F401
from jaxfold._src.rules import reduction as reduction  # noqa: F401
from jaxfold._src.rules import rotation as rotation  # noqa: F401 (facets; after the families)
from jaxfold._src.rules import structural as structural  # noqa: F401
from jaxfold._src.rules.base import DEFAULT, Block, Facts, Inline, Need, Rule, all_rules, call_rules, rule_for

__all__ = ["DEFAULT", "Block", "Facts", "Inline", "Need", "Rule", "all_rules", "call_rules", "rule_for"]
