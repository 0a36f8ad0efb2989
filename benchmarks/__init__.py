"""numbanorm's benchmark suite (run from the repository root: ``python -m benchmarks.run``).

The timing core is ``numbanorm.measure``, shared with the ``numbanorm bench`` command.
"""
