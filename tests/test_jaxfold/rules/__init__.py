"""Per-rule tests, one module per rules module of ``jaxfold._src.rules``.

A package so that pytest puts ``tests/test_jaxfold`` on ``sys.path`` (for the
shared ``fold_checks`` and ``fuzz_programs``) and names these modules
``rules.test_*``.
"""
