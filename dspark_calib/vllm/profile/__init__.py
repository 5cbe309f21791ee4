"""`dspark-calib profile` inside vLLM: the options and plan (plan.py), the driver that starts
the engine in capture mode (driver.py), and the table made from rank 0's capture (table.py)."""
