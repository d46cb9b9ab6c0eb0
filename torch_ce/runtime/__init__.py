"""The run time: what executes when a graph (or a user) binds and gathers.

Windows and pools (``windows``), the bind and its agreement (``binding``, ``bind_step``),
the transports (``cuda``: copy engines; ``host``: shared memory on CPU), the gathers and
the choice of their kernels (``gather``), the C++ library's wrapper (``native``), the
cross-call prefetch park (``prefetch``), the cost calibration (``calibration``) and what it
publishes for the compiler (``cost_model``). Nothing here imports the compile side
(``torch_ce.passes``, ``torch_ce.inductor_lowering``), and no module imports one that
imports it back; ``docs/DESIGN.md`` lists the allowed imports and ``test/test_layout.py``
enforces them.
"""
