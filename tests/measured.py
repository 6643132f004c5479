"""Metric prefixes whose values are measurements of the machine (wall clock, throughput, resident
memory), which two runs of the same steps need not share; every other metric of a step is a function of
the seeds, data and weights, and the resume, restart and multi-host tests compare them exactly."""

MEASURED = ("timing_s/", "perf/", "memory/rss_mb/")
