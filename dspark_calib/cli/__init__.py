"""The `dspark-calib` command: a thin typer app over the library (app.py), the one rule for
output paths (paths.py) and the profile command's progress and log (profile.py)."""
