"""Many requests at once, one home: the schedule (which step a batch runs by how many share it), its measurement
(round costs per batch size in eaglewire's engine, ``measurement``; in a server engine launched here,
``server_measurement``) and the closed loops that bench runs against it (``closed_loop``, ``server_closed_loop``).
The commands' own parts (``tune/load_schedule.py``, ``doctor/load_check.py``, ``bench --concurrency``) call these."""
