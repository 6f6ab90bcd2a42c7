"""Watching a running tritonserver: the stub watchdog (dead and stuck stubs, the server started
again), its recovery (the reloads, an object the watchdog holds), the stubs in ``/proc``, Triton's
repository API and the HTTP probes. Imports nothing of the package outside ``watch/`` (never
``render``, ``models`` or ``launch``).
"""
