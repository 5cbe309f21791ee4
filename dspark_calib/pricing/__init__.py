"""How a step is priced: the policy (policy.py), the integer rules that map a step to a
context (rules.py), the dense tables at any context (costs.py) and their grid (grid.py)."""
