"""`rlframe preflight`: run a config for a step or two at its real layout and check the invariants
every correct RL run keeps (DESIGN.md section 11); checks.py holds them, observer.py watches a
trainer's steps, run.py runs it and reports."""
