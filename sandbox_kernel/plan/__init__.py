"""What to run, decided before anything runs: every setting and its ceiling (settings,
limits, admission), one start's policy, and the sandbox's plan and spec (plan, sandbox_spec).
"""
