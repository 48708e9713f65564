"""The health monitor: the loop's side (watch), the detectors, the alarm catalog and the probes."""
