"""The application on the driver: the trainers' dataflows (trainers/), a run's lifecycle (lifecycle/:
run lock and identity, checkpoints, restarts, node loss, preemption, tracking), `run_training`
(run.py) and the preflight harness (preflight/). The runtime they drive is rlframe.single_controller.
"""
