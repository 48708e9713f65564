"""A run's records and its console: the metrics writer and its sinks, the training dashboard, results as text."""
