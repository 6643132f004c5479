"""A run's lifecycle on the driver: the run directory's lock and identity, checkpoints and resume,
restarts after a worker or node is lost, preemption, tracking (metrics files and sinks), and the
start-up overlap of worker processes with the driver's own work."""
