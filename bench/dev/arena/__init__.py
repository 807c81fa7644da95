"""Developer instruments for the memory arena (``allocators.arena``): the unified replay's CPU
time against the fixed split's (``cpu.py``), and the unified arena against committed
fixed-split sweeps with issue 38's verdicts (``grid.py``)."""
