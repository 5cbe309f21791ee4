"""Observed serving steps: what a step is (step.py) and the rolling parquet files that hold
them (file.py, with the table file's version and migration toolkit)."""
