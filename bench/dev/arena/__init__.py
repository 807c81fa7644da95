"""Developer instruments for the memory arena (``allocators.arena``): the unified replay's CPU
time against the fixed split's (``cpu.py``)."""
